"""benchmarks/engine_limits.py: :func:`measure` returns positive finite numbers under the
documented keys, and its decode-step bytes equal an independent count from the model's
``config.json`` and the sizes in its quantized block file; and benchmarks/speed_ceilings.py
turns canned results into the shares speed.py prints. No speed is asserted."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
import torch

from scripts import load_script

engine_limits = load_script("engine_limits")
speed_ceilings = load_script("speed_ceilings")

CONTEXT = 100
BATCHES = (1, 8)


@pytest.fixture(scope="module")
def model_dir():
    from epdserve.model.loader import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="module")
def limits(model_dir):
    return engine_limits.measure(1, model_dir, batches=BATCHES, context=CONTEXT, gemm_seconds=0.02, mem_mib=16)


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def proc_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":", 1)[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_measure_keys_and_values(limits):
    assert {"threads", "cores", "machine", "cpu_flags", "model", "gemm", "bf16", "memory", "decode"} <= set(limits)
    assert limits["threads"] == 1
    bf16 = bool(proc_flags() & {"avx512_bf16", "amx_bf16", "bf16"})
    assert limits["bf16"]["measured"] is bf16
    assert set(limits["gemm"]) == ({"float32", "bfloat16"} if bf16 else {"float32"})
    for per_t in limits["gemm"].values():
        assert set(per_t) == {"256", "1024"}
        for t, g in per_t.items():
            assert set(g["shapes"]) == {"qkv", "o", "gate_up", "down"}
            for s in g["shapes"].values():
                assert s["flops"] == 2 * int(t) * s["n"] * s["k"]
                assert all(finite_positive(s[k]) for k in ("best_ms", "median_ms", "gflops", "gflops_median"))
                assert 1 <= s["reps"] <= engine_limits.GEMM_MAX_REPS
                # The ceiling is the best library's: torch.mm always, oneDNN where torch has it.
                assert "blas" in s["gflops_by_library"] and s["library"] in s["gflops_by_library"]
                assert s["gflops"] == max(s["gflops_by_library"].values())
            assert all(finite_positive(g[k]) for k in ("forward_flops", "forward_ms", "aggregate_gflops"))
            # The aggregate is FLOP-weighted: between the slowest and the fastest shape.
            rates = [s["gflops"] for s in g["shapes"].values()]
            assert min(rates) * 0.999 <= g["aggregate_gflops"] <= max(rates) * 1.001
    mem = limits["memory"]
    assert mem["bytes"] == 16 * 2**20
    assert all(finite_positive(mem[k]) for k in ("copy_gbs", "read_gbs", "copy_best_ms", "read_best_ms"))
    floors = limits["decode"]["floors"]
    assert [f["batch"] for f in floors] == list(BATCHES)
    for f in floors:
        assert all(finite_positive(f[k]) for k in ("bytes", "floor_ms", "floor_ms_read"))
        assert f["floor_ms"] == pytest.approx(f["bytes"] / mem["copy_gbs"] / 1e6)


def test_shapes_and_flops_from_config(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = engine_limits.matmul_shapes(engine_limits.model_config(model_dir))
    assert shapes == {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * i, h), "down": (h, i)}
    if cfg["hidden_size"] == 576:  # SmolLM2-135M
        assert shapes == {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    per_token = 2 * cfg["num_hidden_layers"] * sum(n * k for n, k in shapes.values())
    assert engine_limits.forward_flops(engine_limits.model_config(model_dir), 300) == 300 * per_token


def _blocks_header(path: Path) -> tuple[dict, int]:
    """The safetensors header and the size of its data section (file size - 8 - header)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), len(raw) - 8 - length


def test_decode_bytes_match_an_independent_count(limits, model_dir):
    from epdserve.model import kernels

    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, d, vocab = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                           cfg["vocab_size"])
    assert cfg.get("tie_word_embeddings"), "the default model ties its LM head to the embedding"
    layer_params = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * inter
    norms = (2 * layers + 1) * h * 4
    blocks_file = model_dir / "quantized" / "blocks.safetensors"
    weights = limits["decode"]["weights"]
    if blocks_file.is_file() and kernels.available():
        header, data_bytes = _blocks_header(blocks_file)
        # Q4_1: 16 bytes of nibbles + float32 scale + float32 min per 32 weights; Q8_0: 32 + 4.
        per_block = {"U8": 24, "I8": 36}
        kinds = {k.rsplit(".", 1)[0]: per_block[v["dtype"]] for k, v in header.items() if k.endswith(".qs")}
        assert len(kinds) == 7 * layers + 1  # q, k, v, o, gate, up, down per layer; the embedding
        embed = vocab * h // 32 * kinds["model.embed_tokens.weight"]
        linear = sum(layer_params // 32 * kinds[f"model.layers.{i}.self_attn.q_proj.weight"] for i in range(layers))
        assert linear + embed == data_bytes  # every block in the file is read once per step
        assert weights["format"] == "gguf-blocks"
        assert (weights["linear"], weights["lm_head"]) == (linear, embed)
        expected_fixed = data_bytes + norms
    else:
        assert weights["format"] == "dense float32"
        expected_fixed = (layers * layer_params + vocab * h) * 4 + norms
    assert weights["other"] == norms
    assert weights["fixed"] == expected_fixed
    kv_per_token = 2 * layers * kv * d * 4  # float32 KV
    assert limits["decode"]["kv_bytes_per_token"] == kv_per_token
    for f in limits["decode"]["floors"]:
        b = f["batch"]
        assert f["bytes"] == expected_fixed + b * h * 4 + b * CONTEXT * kv_per_token


def test_dense_float32_format(model_dir):
    cfg = engine_limits.model_config(model_dir)
    w = engine_limits.weight_read_bytes(model_dir, "float32")
    shapes = engine_limits.matmul_shapes(cfg)
    assert w["linear"] == cfg["num_hidden_layers"] * sum(n * k for n, k in shapes.values()) * 4
    assert w["lm_head"] == cfg["vocab_size"] * cfg["hidden_size"] * 4


def test_speed_shares_from_canned_results(limits, model_dir):
    cfg = limits["model"]
    result = {"completed": 2, "total_input_tokens": 600, "median_ttft_ms": 500.0, "median_itl_ms": 40.0}
    found = speed_ceilings.shares(limits, {"epdserve": {1: result, 8: result}}, 128, model_dir, None)
    e = found["epdserve"]
    p = e["prefill"]
    assert p["prompt_tokens"] == 300
    assert p["flops"] == engine_limits.forward_flops(cfg, 300)
    assert p["gflops"] == pytest.approx(p["flops"] / 0.5 / 1e9)
    assert p["ceiling_tokens"] == 256  # the measured T nearest 300
    assert p["share"] == pytest.approx(p["gflops"] / limits["gemm"]["float32"]["256"]["aggregate_gflops"])
    weights = limits["decode"]["weights"]
    for c in (1, 8):
        d = e["decode"][str(c)]
        assert d["context"] == 300 + 64
        nbytes = weights["fixed"] + c * weights["embedding_row"] + c * 364 * limits["decode"]["kv_bytes_per_token"]
        assert d["bytes"] == pytest.approx(nbytes)
        assert d["share"] == pytest.approx(nbytes / limits["memory"]["copy_gbs"] / 1e6 / 40.0)
    assert speed_ceilings.lines(limits, found)


def test_prefill_profile_splits_a_prefill_into_its_parts(model_dir):
    """benchmarks/prefill_profile.py's in-process split: every part is timed, the parts add
    up to no more than the step, the GEMMs and attention are most of it, and the functions it
    wrapped are back afterwards."""
    from epdserve.model import linear
    from epdserve.model.llama import LlamaModel

    load_script("llama_build")
    load_script("speed_engines")
    load_script("vllm_profile")
    profile = load_script("prefill_profile")
    before = (LlamaModel._attention, linear.Linear.__call__)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 40000, (n,), generator=gen).tolist() for n in (100, 120, 140)]
    got = profile.in_process(str(model_dir), prompts, "auto", "float32")
    parts = got["parts"]
    assert set(parts) == {*profile.PARTS, "step"} and got["prompt_tokens"] == 130
    assert all(parts[p]["median_ms"] > 0 for p in ("GEMMs", "attention", "RMSNorm", "RoPE + KV write", "LM head"))
    assert sum(parts[p]["median_ms"] for p in profile.PARTS) <= parts["step"]["median_ms"] * 1.05
    assert parts["GEMMs"]["median_ms"] + parts["attention"]["median_ms"] > parts["step"]["median_ms"] / 2
    assert (LlamaModel._attention, linear.Linear.__call__) == before


def test_vllm_profile_reads_self_times_per_part_from_a_chrome_trace(tmp_path):
    """benchmarks/vllm_profile.py: an operator's self time is its duration less its direct
    children's, per thread; parts by vLLM's operator names; per request."""
    import gzip

    load_script("llama_build")
    load_script("speed_engines")
    vp = load_script("vllm_profile")
    def op(name, tid, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [  # one thread: a compiled graph around a GEMM and an attention call; another thread's GEMM
        op("## Call CompiledFxGraph None ##", 1, 0, 100), op("_C::onednn_mm", 1, 10, 50),
        op("_C::cpu_attention_with_kv_cache", 1, 70, 20), op("_C::onednn_mm", 2, 5, 40),
        {"ph": "i", "cat": "cpu_op", "name": "marker", "pid": 1, "tid": 1, "ts": 3},
    ]
    assert vp.self_times(events) == {"## Call CompiledFxGraph None ##": 30, "_C::onednn_mm": 90,
                                     "_C::cpu_attention_with_kv_cache": 20}
    names = ("_C::onednn_mm", "_C::cpu_attention_with_kv_cache", "_C::cpu_attn_reshape_and_cache",
             "_C::rms_norm", "_C::rotary_embedding", "## Call CompiledFxGraph None ##", "aten::item")
    assert [vp.part_of(n) for n in names] == ["GEMMs", "attention", "KV write", "RMSNorm", "RoPE",
                                              "compiled graph (fused small operators)", "other"]
    (tmp_path / "rank0").mkdir()
    with gzip.open(tmp_path / "rank0" / "trace.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = vp.split(tmp_path, requests=2)
    assert got["parts"]["GEMMs"] == pytest.approx(0.045) and got["parts"]["attention"] == pytest.approx(0.010)
    assert got["top"][0] == ("_C::onednn_mm", "GEMMs", pytest.approx(0.045))
