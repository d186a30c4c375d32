"""The engine against Hugging Face transformers on the same float32 weights, PD hand-off
inside one process, and preemption under a tiny block pool."""

from __future__ import annotations

import pytest
import torch

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import load_tokenizer

BLOCK = 16
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir():
    return str(resolve_model().path)


@pytest.fixture(scope="module")
def prompts(model_dir):
    """16 prompts: shorter than a block, exact block multiples, and over 1,000 tokens."""
    tok = load_tokenizer(model_dir)
    text = ("The history of computing is a story of people, ideas and machines. "
            "Early calculators were mechanical; later, electronic circuits took over. ")
    ids = tok(text * 80).input_ids
    lengths = [1, 3, 7, 15, BLOCK, 2 * BLOCK, 17, 33, 100, 4 * BLOCK, 8 * BLOCK, 255, 256, 500, 1030, 1200]
    out = [ids[i:i + n] for i, n in enumerate(lengths)]
    assert all(len(p) == n for p, n in zip(out, lengths))
    return out


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    return refs


def generate(engine: LLMEngine, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """Run all prompts through ``engine`` together; returns each one's tokens."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]


def test_greedy_matches_transformers_one_at_a_time(model_dir, prompts, reference):
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=256))
    got = [generate(engine, [p])[0] for p in prompts]
    assert got == reference
    assert engine.stats()["blocks_in_use"] == 0


def test_greedy_matches_transformers_batched(model_dir, prompts, reference):
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=256))
    assert generate(engine, prompts) == reference
    assert engine.stats()["blocks_in_use"] == 0


def test_pd_handoff_in_process_matches_colocated(model_dir, prompts, reference):
    """Prefill engine → KV blocks → decode engine gives the colocated tokens."""
    prefill = LLMEngine(model_dir, EngineConfig(role="prefill", block_size=BLOCK, kv_cache_memory_mb=128))
    decode = LLMEngine(model_dir, EngineConfig(role="decode", block_size=BLOCK, kv_cache_memory_mb=128))
    chosen = [0, 4, 8, 14]
    for i in chosen:
        prefill.add_request(str(i), prompts[i], GREEDY)
    firsts = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert not out.finished and out.kv_block_ids is not None
            kv = prefill.read_kv(out.kv_block_ids)
            prefill.release_kv(out.request_id)
            firsts[out.request_id] = out.token_ids[0]
            decode.add_request(out.request_id, prompts[int(out.request_id)], GREEDY, kv, out.token_ids[0])
    assert prefill.stats()["blocks_in_use"] == 0
    rest = {str(i): [] for i in chosen}
    while decode.has_unfinished():
        for out in decode.step():
            rest[out.request_id].extend(out.token_ids)
    for i in chosen:
        assert [firsts[str(i)]] + rest[str(i)] == reference[i]
    assert decode.stats()["blocks_in_use"] == 0


def test_preemption_under_tiny_pool_completes_with_same_tokens(model_dir, prompts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # Five 31-token prompts fill 10 blocks of 16; each needs a third block after one
    # token, so running sequences must be preempted and recomputed.
    chosen = [p[:31] for p in prompts if len(p) >= 31][:5]
    roomy = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=64))
    expected = generate(roomy, chosen, params)
    tiny = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=10))
    assert generate(tiny, chosen, params) == expected
    assert tiny.stats()["num_preemptions"] > 0
    assert tiny.stats()["blocks_in_use"] == 0


def test_bad_requests_are_refused_with_reasons(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=16))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("b", [10**9], GREEDY)
    with pytest.raises(ValueError, match="context window"):
        engine.add_request("c", [5] * 8190, GREEDY)
    with pytest.raises(ValueError, match="whole pool"):
        engine.add_request("d", [5] * 4000, GREEDY)
    engine.add_request("e", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("e", [5, 6], GREEDY)
    assert engine.abort("e") and engine.stats()["blocks_in_use"] == 0
