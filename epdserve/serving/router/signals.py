"""What the elastic controller reads of the requests (docs/elastic.md)."""

from __future__ import annotations


class SignalRecorder:
    """Since the last :meth:`take`, at the router: ``prefill_queue_ms`` is router + worker queue;
    ``prefill_tokens`` those not found in the prefix cache."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[int, int]] = []  # (prompt tokens, max_tokens)
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
        """``(arrivals, ttfts_ms, prefill_queue_ms, itls_ms, prefill_tokens)``; forgets them."""
        out = (tuple(self.arrivals), tuple(self.ttfts_ms), tuple(self.prefill_queue_ms), tuple(self.itls_ms),
               tuple(self.prefill_tokens))
        self.__init__()
        return out
