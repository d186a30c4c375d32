"""Sampling: greedy limits of top-k/top-p, seeded reproducibility, the filters' effect,
penalties (exact values), min_tokens masking and logprobs of the raw distribution."""

from __future__ import annotations

import torch

from epdserve.engine.request import SamplingParams, Sequence
from epdserve.engine.sampler import _apply_penalties, sample

EOS = 2


def logits_batch(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def seq(params: SamplingParams, prompt=(1, 3, 4), output=()) -> Sequence:
    """A sequence with ``prompt`` and ``output`` tokens already generated."""
    s = Sequence("r", list(prompt), params)
    s.token_ids += list(output)
    s.num_output_tokens = len(output)
    return s


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = logits_batch()
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=1.0, top_p=1e-6)):
        tokens, logprobs = sample(logits.clone(), [seq(params.model_copy(update={"seed": i})) for i in range(4)])
        assert tokens == argmax and logprobs == [None] * 4


def test_seeded_rows_repeat_whatever_the_batch_and_position_matters():
    logits = logits_batch()
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[i:i + 1].clone(), [seq(params)])[0][0] for i in range(4)]
    together = sample(logits.clone(), [seq(params) for _ in range(4)])[0]
    assert alone == together
    # The draw depends on (seed, output position) only: same position, same draws.
    flat = torch.zeros(1, 50)
    at = [[sample(flat.clone(), [seq(params, output=[9] * pos)])[0][0] for pos in range(8)] for _ in range(2)]
    assert at[0] == at[1] and len(set(at[0])) > 1


def test_top_k_and_top_p_keep_draws_inside_the_allowed_set():
    logits = logits_batch(1, 50)[0]
    top5 = set(torch.topk(logits, 5).indices.tolist())
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_probs.cumsum(-1) < 0.5).sum()) + 1].tolist())
    torch.manual_seed(1)
    draws_k = {sample(logits[None].clone(), [seq(SamplingParams(temperature=1.0, top_k=5))])[0][0] for _ in range(300)}
    draws_p = {sample(logits[None].clone(), [seq(SamplingParams(temperature=1.0, top_p=0.5))])[0][0] for _ in range(300)}
    assert draws_k <= top5 and len(draws_k) > 1
    assert draws_p <= nucleus


def test_penalties_follow_openai_and_ctrl_formulas():
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 0.5, 3.0]])
    # prompt [1, 2], output [3, 3, 4]
    s = seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0),
            prompt=[1, 2], output=[3, 3, 4])
    _apply_penalties(logits, [s])
    # repetition: seen 1, 2, 3, 4 (positive / 2, negative * 2); then output counts 3: 2, 4: 1.
    expected = [1.0, 1.0, -4.0, 2.0 - 0.5 * 2 - 0.25, 0.25 - 0.5 - 0.25, 3.0]
    assert torch.allclose(logits[0], torch.tensor(expected)), logits


def test_penalties_touch_only_rows_that_ask():
    logits = logits_batch(3, 50)
    before = logits.clone()
    plain = seq(SamplingParams(temperature=0), output=[5, 5])
    penalised = seq(SamplingParams(temperature=0, frequency_penalty=2.0), output=[5, 5, 6])
    _apply_penalties(logits, [plain, penalised, plain])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert logits[1, 5] == before[1, 5] - 4.0 and logits[1, 6] == before[1, 6] - 2.0
    assert torch.equal(logits[1, 7:], before[1, 7:])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, 10)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7])
    early, reached = seq(params, output=[1]), seq(params, output=[1, 1])
    ignoring = seq(params.model_copy(update={"ignore_eos": True}), output=[1])
    tokens, _ = sample(logits, [early, reached, ignoring], eos_token_ids=(EOS,))
    assert tokens == [5, EOS, EOS]  # ignore_eos leaves EOS alone (vLLM), the stop token is masked


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_k():
    logits = logits_batch(3, 50)
    raw = torch.log_softmax(logits, -1)
    params = [SamplingParams(temperature=0, logprobs=5, frequency_penalty=2.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, logprobs=0, seed=3)]
    seqs = [seq(params[0], output=[int(logits[0].argmax())]), seq(params[1]), seq(params[2])]
    tokens, logprobs = sample(logits.clone(), seqs)
    chosen, top = logprobs[0]
    # The penalty moved the pick off the argmax, but logprobs are of the raw distribution.
    assert tokens[0] != int(logits[0].argmax())
    assert abs(chosen - raw[0, tokens[0]].item()) < 1e-6
    values, ids = raw[0].topk(5)
    assert [t for t, _ in top] == ids.tolist()
    assert torch.allclose(torch.tensor([lp for _, lp in top]), values)
    assert logprobs[1] is None
    assert logprobs[2][1] == [] and abs(logprobs[2][0] - raw[2, tokens[2]].item()) < 1e-6
