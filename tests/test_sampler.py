"""Sampling: greedy limits of top-k/top-p, seeded reproducibility, and the filters' effect."""

from __future__ import annotations

import torch

from epdserve.engine.request import SamplingParams
from epdserve.engine.sampler import sample


def logits_batch(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = logits_batch()
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=1.0, top_p=1e-6)):
        assert sample(logits, [params] * 4, [torch.Generator().manual_seed(i) for i in range(4)]) == argmax


def test_seeded_rows_repeat_whatever_the_batch():
    logits = logits_batch()
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[i:i + 1], [params], [torch.Generator().manual_seed(7)])[0] for i in range(4)]
    together = sample(logits, [params] * 4, [torch.Generator().manual_seed(7) for _ in range(4)])
    assert alone == together


def test_top_k_and_top_p_keep_draws_inside_the_allowed_set():
    logits = logits_batch(1, 50)[0]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_probs.cumsum(-1) < 0.5).sum()) + 1].tolist())
    gen = torch.Generator().manual_seed(1)
    draws_k = {sample(logits[None], [SamplingParams(temperature=1.0, top_k=5)], [gen])[0] for _ in range(300)}
    draws_p = {sample(logits[None], [SamplingParams(temperature=1.0, top_p=0.5)], [gen])[0] for _ in range(300)}
    assert draws_k <= top5 and len(draws_k) > 1
    assert draws_p <= nucleus
