"""What the elastic controller reads of the requests (``serve --elastic``, docs/elastic.md).

The flows report each request's arrival, its first token and every gap between two of its
outputs reaching the router as they happen; :meth:`SignalRecorder.take` hands over and
forgets what came since the last call, which the controller turns into one
:class:`~epdserve.serving.elastic.policy.Sample` with the workers' own numbers.
"""

from __future__ import annotations


class SignalRecorder:
    """Request events since the last :meth:`take`: ``arrivals`` as (prompt tokens,
    max_tokens); ``ttfts_ms`` (arrival to first token at the router, ms) and, per the same
    request, ``prefill_queue_ms`` (router queue + the prefilling worker's queue when its
    first output says it, ms) and ``prefill_tokens`` (the prompt tokens its prefill computed:
    not found in the prefix cache); ``itls_ms`` (gaps between two outputs of a request, ms)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[int, int]] = []
        self.ttfts_ms: list[float] = []
        self.prefill_queue_ms: list[float] = []
        self.prefill_tokens: list[int] = []
        self.itls_ms: list[float] = []

    def arrival(self, prompt_tokens: int, max_tokens: int) -> None:
        self.arrivals.append((prompt_tokens, max_tokens))

    def first_token(self, ttft_ms: float, prefill_queue_ms: float, prefill_tokens: int) -> None:
        self.ttfts_ms.append(ttft_ms)
        self.prefill_queue_ms.append(prefill_queue_ms)
        self.prefill_tokens.append(prefill_tokens)

    def itl(self, gap_ms: float) -> None:
        self.itls_ms.append(gap_ms)

    def take(self) -> tuple[tuple, tuple, tuple, tuple, tuple]:
        """``(arrivals, ttfts_ms, prefill_queue_ms, itls_ms, prefill_tokens)`` since the last
        call, as tuples."""
        out = (tuple(self.arrivals), tuple(self.ttfts_ms), tuple(self.prefill_queue_ms), tuple(self.itls_ms),
               tuple(self.prefill_tokens))
        self.__init__()
        return out
