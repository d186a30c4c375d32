"""One request's sampling values must never break the step for the others on its worker.

Values that passed validation used to raise inside the step and kill every request of the
batch: a tiny ``temperature`` or ``top_p``, an extreme ``repetition_penalty``, and
out-of-vocabulary ``stop_token_ids`` with ``min_tokens``; integers over 64 bits could not
be packed onto the wire. Here: ``SamplingParams``' bounds, the sampler on fake logits for
every such value (no NaN or inf reaches ``multinomial`` or ``topk``), and the engine on the
default model with each bad request batched between two greedy ones, which must give the
tokens they give alone; a row whose sampling still fails ends alone with an error.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from epdserve.engine import engine as engine_module
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams, Sequence
from epdserve.engine.sampler import sample
from epdserve.model.loader import resolve_model

pytestmark = pytest.mark.faults

INT64_MIN, INT64_MAX, INT32_MAX = -2**63, 2**63 - 1, 2**31 - 1

# Values that validation accepts and that crashed the step (temperature 1.0 is the
# OpenAI default; a greedy row would not reach the failing softmax / multinomial).
BAD = {
    "temperature 1e-50": dict(temperature=1e-50),
    "temperature 5e-324": dict(temperature=5e-324),
    "top_p 1e-300": dict(top_p=1e-300),
    "repetition_penalty 1e-300": dict(repetition_penalty=1e-300),
    "repetition_penalty 1e300": dict(repetition_penalty=1e300),
    "repetition_penalty 1e-300 top_k 5": dict(repetition_penalty=1e-300, top_k=5),
}


# --- SamplingParams: the bounds (it is also the router -> worker wire type) ---

def test_integers_are_bounded_to_what_the_wire_and_torch_carry():
    from epdserve.serving import protocol as P

    edge = SamplingParams(max_tokens=INT32_MAX, seed=INT64_MAX, top_k=INT32_MAX,
                          stop_token_ids=[0, INT32_MAX] * 512)
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN
    msg = P.AddRequest(request_id="r", prompt_token_ids=[1], sampling=edge)
    assert P.decode(P.encode(msg)).sampling == edge  # msgpack packs every allowed value
    for bad in (dict(seed=INT64_MAX + 1), dict(seed=INT64_MIN - 1), dict(seed=2**64),
                dict(top_k=INT32_MAX + 1), dict(top_k=2**64), dict(top_k=0), dict(top_k=-2),
                dict(stop_token_ids=[-1]), dict(stop_token_ids=[2**64]),
                dict(stop_token_ids=[1] * 1025), dict(max_tokens=2**64),
                dict(max_tokens=2**64, min_tokens=2**64)):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)


def test_tiny_temperatures_are_clamped_as_vllm_does_and_non_finite_floats_refused():
    assert SamplingParams(temperature=1e-50).temperature == 1e-2
    assert SamplingParams(temperature=5e-324).temperature == 1e-2
    assert SamplingParams(temperature=0).temperature == 0  # greedy stays greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5
    assert SamplingParams(repetition_penalty=1e-300).repetition_penalty == 1e-300
    for bad in (dict(temperature=float("inf")), dict(temperature=float("nan")),
                dict(repetition_penalty=float("inf")), dict(top_p=float("nan"))):
        with pytest.raises(ValidationError, match="finite"):
            SamplingParams(**bad)


def test_validation_messages_stay_readable():
    with pytest.raises(ValidationError, match=r"min_tokens \(5\) must be at most max_tokens \(2\)"):
        SamplingParams(max_tokens=2, min_tokens=5)
    with pytest.raises(ValidationError, match="top_k must be -1"):
        SamplingParams(top_k=0)
    with pytest.raises(ValidationError, match="at most 1024"):
        SamplingParams(stop_token_ids=list(range(1025)))


# --- the sampler on fake logits ---

def fake_logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def seq(params: SamplingParams, prompt=(1, 3, 4, 7, 9), output=()) -> Sequence:
    s = Sequence("r", list(prompt), params)
    s.token_ids += list(output)
    s.num_output_tokens = len(output)
    return s


GREEDY_ROW = SamplingParams(temperature=0)


@pytest.fixture
def finite_spy(monkeypatch):
    """Fail if NaN or +inf reaches ``torch.topk``, or anything but a finite distribution
    with mass reaches ``torch.multinomial`` (-inf logits of masked tokens may reach topk)."""
    topk, multinomial = torch.topk, torch.multinomial

    def checked_topk(x, *args, **kwargs):
        assert not x.isnan().any() and not (x == float("inf")).any(), x
        return topk(x, *args, **kwargs)

    def checked_multinomial(probs, *args, **kwargs):
        assert probs.isfinite().all() and (probs >= 0).all() and probs.sum() > 0, probs
        return multinomial(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", checked_topk)
    monkeypatch.setattr(torch, "multinomial", checked_multinomial)


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_sampler_survives_each_bad_value_and_good_rows_do_not_notice(bad, finite_spy):
    logits = fake_logits()
    alone = [sample(logits[i:i + 1].clone(), [seq(GREEDY_ROW)])[0][0] for i in (0, 2)]
    for seed in range(20):
        tokens, _ = sample(logits.clone(), [seq(GREEDY_ROW), seq(SamplingParams(seed=seed, **bad)),
                                            seq(GREEDY_ROW)])
        assert [tokens[0], tokens[2]] == alone and 0 <= tokens[1] < 50


def test_extreme_repetition_penalties_keep_their_limits():
    """1e-300 favours the seen tokens with a positive logit (all tie at the top); 1e300
    leaves a logit of exactly 0 at 0 (CTRL multiplies it), where 0 * inf was NaN."""
    logits = fake_logits(1, 50)
    prompt = (1, 3, 4, 7, 9)
    positive_seen = {t for t in prompt if logits[0, t] > 0}
    assert positive_seen
    draws = {sample(logits.clone(), [seq(SamplingParams(repetition_penalty=1e-300, seed=s))])[0][0]
             for s in range(40)}
    assert draws == positive_seen
    zeros = torch.zeros(1, 10)
    draws = {sample(zeros.clone(), [seq(SamplingParams(repetition_penalty=1e300, seed=s))])[0][0]
             for s in range(40)}
    assert len(draws) > 1 and draws & set(prompt)


def test_top_p_tiny_keeps_the_top_token():
    logits = fake_logits(1, 50)
    for s in range(10):
        assert sample(logits.clone(), [seq(SamplingParams(top_p=1e-300, seed=s))])[0] == [int(logits.argmax())]


def test_out_of_vocabulary_stop_ids_are_skipped_by_the_mask():
    logits = torch.zeros(2, 10)
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7, 10, 10**6, INT32_MAX])
    tokens, _ = sample(logits.clone(), [seq(GREEDY_ROW), seq(params)])
    assert tokens == [7, 5]  # the in-vocabulary stop id is still masked


def test_sample_leaves_the_logits_unchanged():
    """The engine samples rows again from the same logits when a batch fails."""
    logits = fake_logits()
    before = logits.clone()
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=1.0),
              SamplingParams(min_tokens=4, stop_token_ids=[3], seed=1), GREEDY_ROW]
    sample(logits, [seq(p, output=[3, 3]) for p in params], eos_token_ids=(2,))
    assert torch.equal(logits, before)


# --- the engine on the default model ---

GOOD = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPTS = {"g1": [1, 504, 3458, 282, 1617, 314], "g2": [1, 20, 2132, 28, 253]}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(str(resolve_model().path), EngineConfig(block_size=16, kv_cache_memory_mb=32))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Add ``requests`` (id -> (prompt, params)) and step until done: id -> its outputs."""
    outputs = {rid: [] for rid in requests}
    try:
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].append(out)
    finally:  # a failed test leaves the module's engine empty for the next one
        for rid in list(engine.seqs):
            engine.abort(rid)
    assert engine.stats()["blocks_in_use"] == 0 and not engine.seqs
    return outputs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.fixture(scope="module")
def alone(engine):
    return {rid: tokens(run(engine, {rid: (p, GOOD)})[rid]) for rid, p in PROMPTS.items()}


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_each_bad_value_batched_with_two_good_requests(engine, alone, bad):
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=0, **bad)
    outs = run(engine, {"g1": (PROMPTS["g1"], GOOD), "bad": ([1, 9, 44, 230], params),
                        "g2": (PROMPTS["g2"], GOOD)})
    assert {rid: tokens(outs[rid]) for rid in PROMPTS} == alone
    assert outs["bad"][-1].finish_reason == "length" and len(tokens(outs["bad"])) == 5


def test_out_of_vocabulary_stop_ids_are_refused_at_add_request(engine, alone):
    vocab = engine.model.config.vocab_size
    bad = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[5, vocab + 7])
    with pytest.raises(ValueError, match=f"{vocab + 7}.*{vocab}"):
        engine.add_request("bad", [1, 9, 44], bad)
    assert not engine.seqs and engine.stats()["blocks_in_use"] == 0
    outs = run(engine, {rid: (p, GOOD) for rid, p in PROMPTS.items()})
    assert {rid: tokens(o) for rid, o in outs.items()} == alone


def test_a_row_whose_sampling_fails_ends_alone_with_an_error(engine, monkeypatch):
    """A batch whose sample() raises is sampled row by row: the row that still fails gets
    an error output and is removed with its blocks; the others (one with penalties, whose
    logits the failed batch call must not have changed) give their tokens alone."""
    penalised = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                               frequency_penalty=0.5)
    reqs = {"g1": (PROMPTS["g1"], GOOD), "g2": (PROMPTS["g2"], penalised)}
    expected = {rid: tokens(run(engine, {rid: r})[rid]) for rid, r in reqs.items()}
    real = engine_module.sample

    def failing(logits, seqs, eos_token_ids=()):
        result = real(logits, seqs, eos_token_ids)  # as a failure late in sample() would
        if any(s.request_id == "bad" and s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return result

    monkeypatch.setattr(engine_module, "sample", failing)
    outs = run(engine, {"g1": reqs["g1"], "bad": ([1, 9, 44, 230], GOOD), "g2": reqs["g2"]})
    assert {rid: tokens(outs[rid]) for rid in reqs} == expected
    last = outs["bad"][-1]
    assert tokens(outs["bad"]) == tokens(outs["bad"][:2]) and len(outs["bad"]) == 3
    assert last.finished and last.finish_reason == "error" and last.token_ids == []
    assert "sampl" in last.error and "tensor" not in last.error
