"""Prompt log-probabilities: what vLLM's ``prompt_logprobs`` (and OpenAI's completions
``echo`` with ``logprobs``, which lm-evaluation-harness scores log-likelihood tasks with)
return for every prompt token but the first: its logprob given the tokens before it, its
rank, and the top-k alternatives.

They are the raw log-softmax of the model's logits (vLLM's default ``logprobs_mode``
"raw_logprobs": no penalty, temperature or mask), computed only for the requests that ask,
from the hidden states of the prefill step(s) that compute their prompt: the normal step
keeps computing the logits of the sampled rows alone. A prompt of P tokens gives P - 1
entries (the logits at position p score token p + 1; those at the last position score the
first generated token, which is the sampled row's business). Chunked prefills add each
chunk's entries; a request asking for them must compute every prompt position, so the
prefix cache does not serve it (``PrefixCache.match``), as vLLM recomputes them too.
"""

from __future__ import annotations

from typing import Callable

import torch

# (the token's logprob, its rank in the distribution (1: the most likely), [(token id,
# logprob)] of the top k, best first)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]

# Prompt tokens x (k + 1) entries one request may ask for: they travel in one worker
# message (16 MiB frames; an entry packs into about 14 bytes) and one HTTP response. A
# 8,192-token prompt with the top 20 fits (172,032).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
# Rows whose logits are materialised at once: a 8,192-token prompt's logits over a
# 49,152-token vocabulary would take 1.6 GB; 128 rows take 24 MiB.
CHUNK_ROWS = 128


def check_size(num_prompt_tokens: int, k: int) -> None:
    """Raises ``ValueError`` when a prompt of ``num_prompt_tokens`` tokens with the top
    ``k`` alternatives exceeds :data:`MAX_PROMPT_LOGPROB_ENTRIES`."""
    entries = num_prompt_tokens * (k + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(f"prompt_logprobs: {num_prompt_tokens} prompt tokens x {k + 1} entries is {entries}, "
                         f"over the limit of {MAX_PROMPT_LOGPROB_ENTRIES}")


@torch.inference_mode()
def compute(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int],
            k: int) -> list[PromptLogprob]:
    """The :data:`PromptLogprob` of each row of ``hidden [R, hidden]`` (the final hidden
    states of the positions before the ``targets``, R token ids; on any device, where the
    logprobs are computed and from which only the entries come back); ``logits_of(hidden
    rows)`` gives their logits ``[r, vocab]`` (``LlamaModel.logits``), :data:`CHUNK_ROWS`
    rows at a time."""
    out: list[PromptLogprob] = []
    target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for lo in range(0, len(targets), CHUNK_ROWS):
        logprobs = torch.log_softmax(logits_of(hidden[lo:lo + CHUNK_ROWS]), dim=-1)
        t = target[lo:lo + CHUNK_ROWS]
        chosen = logprobs.gather(1, t.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        out += [(lp, rank, list(zip(ids, lps))) for lp, rank, ids, lps in
                zip(chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())]
    return out


class PromptLogprobsCollector:
    """The prompt logprobs of an engine's requests that asked for them, collected over
    their prefill step(s) until their first token (:meth:`take`). ``logits_of``: the
    model's ``logits`` (final norm and LM head over hidden states)."""

    def __init__(self, logits_of: Callable[[torch.Tensor], torch.Tensor]):
        self.logits_of = logits_of
        self.pending: dict[str, list[PromptLogprob]] = {}

    def start(self, request_id: str, num_prompt_tokens: int, k: int) -> None:
        """Collect for ``request_id`` (top ``k``). Raises ``ValueError`` as :func:`check_size`."""
        check_size(num_prompt_tokens, k)
        self.pending[request_id] = []

    def sink(self, batch) -> Callable[[torch.Tensor], None] | None:
        """What the step's forward pass gives its hidden states ``[T, hidden]`` to (see
        ``runner.run``), for ``batch`` (a ``ScheduledBatch`` whose sequences'
        ``num_computed_tokens`` are those before the step); None when no sequence of the
        batch collects, so that the step computes only its sampled rows' logits."""
        if not any(seq.request_id in self.pending for seq in batch.seqs):
            return None

        def collect(hidden: torch.Tensor) -> None:
            row = 0
            for seq, n in zip(batch.seqs, batch.num_tokens):
                got = self.pending.get(seq.request_id)
                if got is not None:
                    start = seq.num_computed_tokens
                    # Positions already scored (before a preemption's recompute) are skipped.
                    first, end = max(start, len(got)), min(start + n, seq.num_prompt_tokens - 1)
                    if first < end:
                        got += compute(self.logits_of, hidden[row + first - start:row + end - start],
                                       seq.token_ids[first + 1:end + 1], seq.sampling.prompt_logprobs)
                row += n

        return collect

    def take(self, request_id: str) -> list[PromptLogprob] | None:
        """The request's collected entries (one per prompt token but the first), once; None
        if it did not ask or they were taken."""
        return self.pending.pop(request_id, None)
