"""Weight formats (model/linear.py): names and their resolution by role, which matmul a step
of M rows runs, the bytes each format holds, bfloat16 weights' divergence from float32
bounded by the top-2 margin, and the formats a model cannot hold refused at start-up.
Greedy parity of the float32 formats with transformers: tests/test_engine.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model import kernels, linear, quant

from conftest import generate

NEEDS_KERNELS = pytest.mark.skipif(not kernels.cpu_supported(), reason="the GGUF block kernels need AVX2 and FMA")
F32, BF16 = torch.float32, torch.bfloat16
# bfloat16 weights keep 8 bits of mantissa: a logit moves by up to a few tenths here, so
# greedy tokens may part where float32's top two logits are that close.
BF16_MARGIN = 0.5


def test_names_round_trip():
    for name in linear.WEIGHT_FORMATS[1:]:
        assert linear.parse(name).name == name
    assert linear.parse("q4_1+bf16") == linear.WeightFormat(blocks=True, dense=BF16)
    assert linear.parse("q4_1") == linear.WeightFormat(blocks=True, dense=None)
    for bad in ("auto", "q4_0", "F32", ""):
        with pytest.raises(ValueError, match="expected one of f32, bf16, q4_1"):
            linear.parse(bad)


def test_auto_follows_the_role_and_the_model():
    assert linear.resolve("auto", F32, True, prefill=True, decode=False).name == "f32"
    assert linear.resolve("auto", F32, True, prefill=False, decode=True).name == "q4_1"
    assert linear.resolve("auto", F32, True).name == "q4_1+f32"  # colocated, elastic
    assert linear.resolve("auto", F32, False, prefill=False, decode=True).name == "f32"  # no GGUF blocks
    assert linear.resolve("auto", BF16, True).name == "bf16"  # a bfloat16 model: its own dtype
    assert linear.resolve("bf16", F32, False).name == "bf16"  # bfloat16 GEMMs in a float32 model


def test_formats_a_model_cannot_hold():
    for name in ("q4_1", "f32", "q4_1+bf16"):
        with pytest.raises(ValueError, match=re.escape(f"--weight-format {name} needs --dtype float32 (this model runs in bfloat16)")):
            linear.resolve(name, BF16, True)
    with pytest.raises(ValueError, match=r"--weight-format q4_1\+f32: this model has no Q4_1 / Q8_0 GGUF blocks"):
        linear.resolve("q4_1+f32", F32, False)
    with pytest.raises(ValueError, match="blocks or a dense weight"):
        linear.Linear(None, None)


@NEEDS_KERNELS
def test_steps_run_on_the_blocks_or_the_dense_copy_by_rows(model_info):
    b = quant.load_blocks(model_info.path)["model.layers.0.mlp.down_proj.weight"]
    w = linear.Linear(b, None).dequantize()
    both = linear.Linear(b, w, kernel_rows=24)
    gen = torch.Generator().manual_seed(0)
    small = torch.randn(24, w.shape[1], generator=gen)
    large = torch.randn(25, w.shape[1], generator=gen)
    assert torch.equal(both(small), torch.ops.epdserve.quant_mm(small, b.qs, b.scales, b.mins))
    assert torch.equal(both(large), F.linear(large, w))
    assert both.kernel_tensors(1) == [b.qs, b.scales, b.mins]
    assert both.kernel_tensors(25)[0] is w
    dense16 = linear.Linear(None, w.to(BF16))
    y = dense16(large)
    assert y.dtype == F32 and torch.equal(y, F.linear(large.to(BF16), w.to(BF16)).float())
    packed = linear.Linear(None, linear.pack(w.to(BF16)))  # oneDNN's layout: the same products
    assert packed.dense.is_mkldnn == torch.backends.mkldnn.is_available() and packed.dense.shape == w.shape
    assert torch.equal(packed(large), y) and torch.equal(packed(large.to(BF16)), y.to(BF16))
    assert packed.nbytes() == w.numel() * 2
    blocks_bytes = linear.Linear(b, None).nbytes()
    assert blocks_bytes == w.numel() * 24 // 32  # Q4_1 here: 16 bytes of quants + float32 d and m per 32
    assert both.nbytes() == blocks_bytes + w.numel() * 4 and dense16.nbytes() == w.numel() * 2


def test_bf16_weights_part_from_float32_only_where_its_top_two_are_close(model_info, tokenizer):
    """A float32 model with bfloat16 GEMMs (the prefill format of a CPU with AMX / AVX512-BF16)
    against dense float32: each prompt's greedy tokens agree until the first step where
    float32's top-2 logprob margin is under BF16_MARGIN, and the KV blocks all come back."""
    prompts = [tokenizer(text).input_ids for text in (
        "The history of computing is a story of people, ideas and machines.",
        "Write a short poem about the sea and the wind.",
        "List three prime numbers and explain why each is prime.")]
    path = str(model_info.path)
    ref = LLMEngine(path, EngineConfig(kv_cache_memory_mb=32, weight_format="f32"))
    with_logprobs = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    margins = []
    for p in prompts:
        ref.add_request("r", p, with_logprobs)
        steps = []
        while ref.has_unfinished():
            for out in ref.step():
                steps += [(tok, lp[1][0][1] - lp[1][1][1]) for tok, lp in zip(out.token_ids, out.logprobs)]
        margins.append(steps)
    engine = LLMEngine(path, EngineConfig(kv_cache_memory_mb=32, weight_format="bf16"))
    assert engine.model.weight_format.name == "bf16" and engine.model.layers[0]["qkv"].dense.dtype == BF16
    got = generate(engine, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for tokens, steps in zip(got, margins):
        parted = next((i for i, (a, (b, _)) in enumerate(zip(tokens, steps)) if a != b), None)
        if parted is not None:
            assert steps[parted][1] < BF16_MARGIN, (parted, steps[parted])
    assert engine.stats()["blocks_in_use"] == 0 and ref.stats()["blocks_in_use"] == 0


def test_engine_refuses_a_format_the_model_cannot_hold(model_info):
    with pytest.raises(ValueError, match="--weight-format q4_1 needs --dtype float32"):
        LLMEngine(str(model_info.path), EngineConfig(dtype="bfloat16", kv_cache_memory_mb=8, weight_format="q4_1"))
