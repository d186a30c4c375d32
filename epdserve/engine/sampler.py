"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from epdserve.engine.request import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of ``logits [S, vocab]`` (float32).

    Greedy rows (temperature 0) take the argmax. Other rows divide by the temperature,
    keep the ``top_k`` largest logits and the smallest set whose probability reaches
    ``top_p`` (nucleus sampling, Holtzman et al. 2019), and draw with the request's seeded
    generator when it has one, so a seeded request gives the same tokens in any batch.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.temperature == 0:
            continue
        row_logits = logits[row] / p.temperature
        if 0 < p.top_k < row_logits.shape[-1]:
            kth = torch.topk(row_logits, p.top_k).values[-1]
            row_logits = row_logits.masked_fill(row_logits < kth, float("-inf"))
        probs = torch.softmax(row_logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep a token while the mass before it is below top_p (the first always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens
