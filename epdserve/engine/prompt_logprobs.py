"""Prompt logprobs as vLLM's ``prompt_logprobs`` (raw log-softmax): P - 1 entries for a P-token prompt
(the logits at p score token p + 1); requests asking for them bypass the prefix cache (vLLM recomputes too)."""

from __future__ import annotations

from typing import Callable

import torch

# (logprob, rank (1: most likely), [(token id, logprob)] of the top k, best first)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]

# Prompt tokens x (k + 1): one 16 MiB worker frame at ~14 bytes an entry; 8,192 tokens x top 20 fits.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
# Logit rows materialised at once: 128 x a 49,152 vocabulary is 24 MiB (a 8,192-token prompt: 1.6 GB).
CHUNK_ROWS = 128


def check_size(num_prompt_tokens: int, k: int) -> None:
    """Raises ValueError over :data:`MAX_PROMPT_LOGPROB_ENTRIES`."""
    entries = num_prompt_tokens * (k + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(f"prompt_logprobs: {num_prompt_tokens} prompt tokens x {k + 1} entries is {entries}, "
                         f"over the limit of {MAX_PROMPT_LOGPROB_ENTRIES}")


@torch.inference_mode()
def compute(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int],
            k: int) -> list[PromptLogprob]:
    """One per row of ``hidden [R, hidden]`` (any device), via ``logits_of``, :data:`CHUNK_ROWS` rows at a time."""
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
    """Collected over a request's prefill steps until :meth:`take`."""

    def __init__(self, logits_of: Callable[[torch.Tensor], torch.Tensor]):
        self.logits_of = logits_of
        self.pending: dict[str, list[PromptLogprob]] = {}

    def start(self, request_id: str, num_prompt_tokens: int, k: int) -> None:
        """Raises ValueError as :func:`check_size`."""
        check_size(num_prompt_tokens, k)
        self.pending[request_id] = []

    def sink(self, batch) -> Callable[[torch.Tensor], None] | None:
        """Takes the step's hidden states ``[T, hidden]``; None when no sequence of ``batch`` collects."""
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
        """Once; None if not asked for or already taken."""
        return self.pending.pop(request_id, None)
