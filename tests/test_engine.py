"""The engine against Hugging Face transformers on the same float32 weights (in each weight
format whose arithmetic is float32: the GGUF's blocks, a dense copy, both), PD hand-off
inside one process (a dense prefill engine to a blocks-only decode one too), chunked
prefill against whole prefill, and preemption under a tiny block pool; float32 on either
GEMM library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.kv_source import TensorKV
from epdserve.engine.request import SamplingParams
from epdserve.model import kernels, linear, tuning
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import load_tokenizer

from conftest import generate

BLOCK = 16
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
NEEDS_KERNELS = pytest.mark.skipif(not kernels.cpu_supported(), reason="the GGUF block kernels need AVX2 and FMA")


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


def test_greedy_matches_transformers_one_at_a_time(model_dir, prompts, reference):
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=256))
    got = [generate(engine, [p], GREEDY)[0] for p in prompts]
    assert got == reference
    assert engine.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("weight_format", ["auto", "f32", pytest.param("q4_1", marks=NEEDS_KERNELS)])
def test_greedy_matches_transformers_batched(model_dir, prompts, reference, weight_format):
    """Prompts of 1-1,200 tokens in one batch: prefill steps far past every kernel cut-over,
    decode steps of 16 rows; auto is q4_1+f32 here (an engine that prefills and decodes)."""
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=256, weight_format=weight_format))
    auto = "q4_1+f32" if kernels.cpu_supported() else "f32"
    assert engine.model.weight_format.name == {"auto": auto}.get(weight_format, weight_format)
    assert generate(engine, prompts, GREEDY) == reference
    assert engine.stats()["blocks_in_use"] == 0


def test_greedy_matches_transformers_on_the_other_float32_gemm(model_dir, prompts, reference, monkeypatch):
    """Whichever float32 GEMM library a machine measured faster (MKL's sgemm on the plain
    weights, oneDNN on weights packed once), the greedy tokens are transformers': the one
    this machine chose runs in the tests above, the other is forced here."""
    probe = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=16, weight_format="f32"))
    gemm = next(g for g in linear.F32_GEMMS if g != probe.model.tuned["f32_gemm"].value)
    chosen = tuning.Tuned(gemm, tuning.CACHE, Path("forced-by-the-test"))
    monkeypatch.setattr(linear, "measured_f32_gemm", lambda layers, force=False: chosen)
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=256, weight_format="f32"))
    assert engine.model.layers[0]["qkv"].dense.is_mkldnn == (gemm == "onednn")
    assert engine.model.tuned["f32_gemm"] is chosen
    assert generate(engine, prompts, GREEDY) == reference


@pytest.mark.parametrize("prefill_format, decode_format",
                         [("auto", "auto"), pytest.param("f32", "q4_1", marks=NEEDS_KERNELS)])
def test_pd_handoff_in_process_matches_colocated(model_dir, prompts, reference, prefill_format, decode_format):
    """Prefill engine → KV blocks → decode engine gives the colocated tokens, also from a
    prefill engine on dense weights to a decode engine on the GGUF's blocks (a PD
    deployment's auto formats)."""
    prefill = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=128, weight_format=prefill_format))
    decode = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=128, weight_format=decode_format))
    chosen = [0, 4, 8, 14]
    for i in chosen:
        prefill.add_request(str(i), prompts[i], GREEDY, hold_kv=True)
    firsts = {}
    while prefill.has_unfinished():
        for out in prefill.step():
            assert not out.finished and out.kv_block_ids is not None
            kv = prefill.read_kv(out.kv_block_ids)
            prefill.release_kv(out.request_id)
            firsts[out.request_id] = out.token_ids[0]
            decode.add_request(out.request_id, prompts[int(out.request_id)], GREEDY, TensorKV(kv), out.token_ids[0])
    assert prefill.stats()["blocks_in_use"] == 0
    rest = {str(i): [] for i in chosen}
    while decode.has_unfinished():
        for out in decode.step():
            rest[out.request_id].extend(out.token_ids)
    for i in chosen:
        assert [firsts[str(i)]] + rest[str(i)] == reference[i]
    assert decode.stats()["blocks_in_use"] == 0


def test_chunked_prefill_matches_unchunked_with_running_decodes(model_dir, prompts):
    """64 tokens a step: prompts of 255, 256 and 500 tokens are prefilled in chunks in the
    same steps as the short prompts' decodes, and give the unchunked run's greedy tokens."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chosen = [prompts[i] for i in (1, 2, 5, 11, 12, 13)]  # 3, 7, 32, 255, 256, 500 tokens
    whole = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=64, enable_chunked_prefill=False))
    assert whole.scheduler.config.max_num_batched_tokens == whole.max_model_len  # unchunked: the context window
    expected = generate(whole, chosen, params)
    chunked = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=64, max_num_batched_tokens=64))
    steps = []
    schedule = chunked.scheduler.schedule

    def recording():  # the real scheduler; remembers each step's (is prefilling, tokens)
        batch = schedule()
        steps.append([(s.is_prefilling, n) for s, n in zip(batch.seqs, batch.num_tokens)])
        return batch

    chunked.scheduler.schedule = recording
    assert generate(chunked, chosen, params) == expected
    assert max(sum(n for _, n in step) for step in steps) <= 64
    mixed = [step for step in steps if (False, 1) in step and any(p and n > 1 for p, n in step)]
    assert len(mixed) >= 500 // 64, "long prefills ran in chunks beside decodes"
    assert chunked.stats()["blocks_in_use"] == 0
    # The default is chunked, as vLLM's, with what this machine prefills in half a second a step
    # (tests/test_step_budget.py).
    default = LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=16))
    assert default.scheduler.config.enable_chunked_prefill
    assert default.scheduler.config.max_num_batched_tokens == default.tuned["max_num_batched_tokens"].value


def test_unchunked_budget_refuses_a_request_it_could_never_schedule(model_dir):
    """Without chunked prefill a prompt (and, after a preemption, its generated tokens) is
    computed in one step: a request longer than the step's budget is refused when added,
    not left at the head of the queue forever."""
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_memory_mb=16, max_num_batched_tokens=64,
                                               enable_chunked_prefill=False))
    with pytest.raises(ValueError, match="70 tokens, over the 64 tokens a step computes without chunked prefill"):
        engine.add_request("long", list(range(1, 61)), SamplingParams(max_tokens=10))
    engine.add_request("fits", list(range(1, 55)), SamplingParams(max_tokens=10, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["blocks_in_use"] == 0


def test_preemption_under_tiny_pool_completes_with_same_tokens(model_dir, prompts):
    """20 requests at once in 12 blocks of 16 tokens (each needs up to 5): running
    sequences are preempted and recomputed, with prefix caching on and half of the prompts
    sharing a 40-token prefix, so that cached blocks are shared, freed, evicted and found
    again around the preemptions. Tokens equal a run with room and no prefix cache."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = prompts[-1]
    chosen = [text[:40] + text[300 + 9 * i:305 + 10 * i] if i % 2 == 0 else text[50 * i:50 * i + 30 + i]
              for i in range(20)]
    roomy = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=64, enable_prefix_caching=False))
    expected = generate(roomy, chosen, params)
    tiny = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=12))
    assert generate(tiny, chosen, params) == expected
    stats = tiny.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["blocks_in_use"] == 0


def test_a_resumed_request_continues_as_if_never_moved(model_dir, prompts):
    """A request moved to another worker after k tokens (``resume_ids``) makes the rest of the same greedy and
    seeded output, its k tokens counted as output (max_tokens, min_tokens, penalties, the seeded draws);
    resume_ids at max_tokens or beside KV are refused."""
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=64))
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, frequency_penalty=0.5, min_tokens=12)
    for params in (SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), seeded):
        whole = generate(engine, prompts[:3], params)
        for k in (1, 5, 11):
            for i, prompt in enumerate(prompts[:3]):
                engine.add_request(f"moved-{k}-{i}", prompt, params, resume_ids=whole[i][:k])
            rest = {}
            while engine.has_unfinished():
                for out in engine.step():
                    rest.setdefault(out.request_id, []).extend(out.token_ids)
            assert [rest[f"moved-{k}-{i}"] for i in range(3)] == [w[k:] for w in whole], (params, k)
    with pytest.raises(ValueError, match="resume_ids .12 tokens. come without kv and under max_tokens .12."):
        engine.add_request("full", prompts[0], seeded, resume_ids=whole[0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", prompts[0], seeded, resume_ids=[10**6])
    assert engine.stats()["blocks_in_use"] == 0


def test_recomputed_tokens_and_first_decode_step_are_reported(model_dir, prompts):
    """A decode engine imports two prompts' KV into a pool too small for both to finish
    together: the one preempted reports the tokens it computed again, which are exactly
    what its steps computed beyond what was needed; each reports its step that imported
    the KV, less the import (ms, within its decode time)."""
    prefill = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kv_cache_memory_mb=64))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    chosen = {"a": prompts[10], "b": prompts[9]}  # 128 and 100 tokens: 11 and 9 blocks at the end
    decode = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, num_kv_blocks=17, enable_prefix_caching=False))
    for rid, p in chosen.items():
        prefill.add_request(rid, p, params, hold_kv=True)
    while prefill.has_unfinished():
        for out in prefill.step():
            kv = TensorKV(prefill.read_kv(out.kv_block_ids))
            prefill.release_kv(out.request_id)
            decode.add_request(out.request_id, chosen[out.request_id], params, kv, out.token_ids[0])
    computed, timings = 0, {}
    while decode.has_unfinished():
        steps = decode.num_steps
        outs = decode.step()
        computed += decode.last_step_tokens if decode.num_steps > steps else 0
        timings.update({o.request_id: o.timings for o in outs if o.finished})
    assert decode.stats()["num_preemptions"] > 0
    needed = 2 * (params.max_tokens - 1)  # tokens 1..39 of each, its prompt imported
    assert sum(t.recomputed_tokens for t in timings.values()) == computed - needed > 0
    for t in timings.values():
        assert 0 < t.first_decode_ms < t.decode_ms - t.kv_import_ms


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
