"""The fused layer kernels (model/layer_kernels.cpp) against their PyTorch versions
(model/layer_ops.py *_torch), on SmolLM2-135M's shapes (9 query heads, 3 KV heads, head
dim 64, hidden 576), and a whole model with them against one without."""

from __future__ import annotations

import pytest
import torch

from epdserve.model import kernels, layer_ops
from epdserve.model.llama import AttentionMetadata, LlamaModel, PrefillSeq

pytestmark = pytest.mark.skipif(not kernels.cpu_supported(), reason="the kernels need AVX2 and FMA")

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the kernels failed to build (see the log)"


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype, out", [(torch.float32, None), (torch.float32, BF16), (BF16, None)])
def test_rms_norm_matches_transformers_order(dtype, out):
    """Float32 within summation noise (a bfloat16 result within its rounding of that noise);
    a bfloat16 model's norm bit-identical to transformers' (its rounding steps mirrored)."""
    x, w = (randn(7, 576) * 3).to(dtype), randn(576, seed=1).to(dtype)
    got = layer_ops.rms_norm(x, w, 1e-5, out)
    expected = layer_ops.rms_norm_torch(x, w, 1e-5).to(out or dtype)
    assert got.dtype == (out or dtype)
    if dtype == BF16:
        assert torch.equal(got, expected)
    else:
        tol = 8e-3 if out == BF16 else 1e-5
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, out", [(torch.float32, None), (torch.float32, BF16), (BF16, None)])
def test_silu_mul_matches_pytorch(dtype, out):
    """silu(gate) * up: float32 within an ulp-level difference of PyTorch's exp; bfloat16
    bit-identical (PyTorch's float32 arithmetic and roundings)."""
    gate_up = (randn(5, 2 * 1536) * 4).to(dtype)
    got = layer_ops.silu_mul(gate_up, out)
    expected = layer_ops.silu_mul_torch(gate_up.clone()).to(out or dtype)
    assert got.shape == (5, 1536) and got.dtype == (out or dtype)
    if dtype == BF16:
        assert torch.equal(got, expected)
    else:
        tol = 8e-3 if out == BF16 else 1e-5
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, delta_dtype", [(torch.float32, torch.float32), (torch.float32, BF16), (BF16, BF16)])
def test_rms_norm_with_delta_is_the_add_then_the_norm(dtype, delta_dtype):
    """The residual add fused into the norm: x updated in place bit for bit as ``add_``
    updates it, and the norm the kernel gives the updated x alone."""
    x, w = (randn(9, 576) * 3).to(dtype), randn(576, seed=1).to(dtype)
    delta = randn(9, 576, seed=2).to(delta_dtype)
    added = x.clone().add_(delta)
    got = layer_ops.rms_norm(x, w, 1e-5, BF16, delta)
    assert torch.equal(x, added)
    assert torch.equal(got, layer_ops.rms_norm(added, w, 1e-5, BF16))


@pytest.mark.parametrize("dtype, out", [(torch.float32, torch.float32), (torch.float32, BF16), (BF16, BF16),
                                        (BF16, torch.float32)])
def test_silu_mul_is_the_same_on_every_width(dtype, out):
    """The AVX-512 variant (I a multiple of 16, where the CPU has it) gives the AVX2 code's
    results bit for bit: the same rows with I = 1,544 (a multiple of 8 only) run the AVX2 code."""
    gate, up = (randn(7, 1536) * 6).to(dtype), (randn(7, 1536, seed=1) * 2).to(dtype)
    pad = torch.zeros(7, 8, dtype=dtype)
    wide = layer_ops.silu_mul(torch.cat([gate, up], 1), out)
    narrow = layer_ops.silu_mul(torch.cat([gate, pad, up, pad], 1), out)[:, :1536]
    assert torch.equal(wide, narrow)


def rope_case(dtype):
    positions, slots = torch.tensor([0, 5, 17, 3, 100, 2, 9]), torch.tensor([3, 9, 1, 40, 63, 0, 7])
    qkv = randn(7, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    cos, sin = randn(200, HEAD_DIM, seed=1).to(dtype), randn(200, HEAD_DIM, seed=2).to(dtype)
    return qkv, positions, slots, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rope_and_kv_write_are_bit_identical(dtype):
    """In the model's dtype throughout (float32, or a bfloat16 model's rounding of each product)."""
    qkv, positions, slots, cos, sin = rope_case(dtype)
    caches = [torch.zeros(64, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(4)]
    expected = qkv.clone()
    layer_ops.rope_write_kv(qkv, positions, cos, sin, caches[0], caches[1], slots, HEADS)
    layer_ops.rope_write_kv_torch(expected, positions, cos, sin, caches[2], caches[3], slots, HEADS)
    assert torch.equal(qkv, expected)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0][slots].abs().sum() > 0 and caches[0][10:40].abs().sum() == 0  # only the given slots


@pytest.mark.parametrize("cache_dtype", [torch.float32, BF16])
def test_rope_on_bfloat16_gemm_output_computes_in_float32(cache_dtype):
    """A float32 model's bfloat16 GEMM output: RoPE in float32 (as on its float32 cast), Q
    rounded once into qkv, K and V written to the cache from the float32 values."""
    qkv, positions, slots, cos, sin = rope_case(torch.float32)
    qkv = qkv.to(BF16)
    reference = qkv.float()
    caches = [torch.zeros(64, KV_HEADS, HEAD_DIM) for _ in range(2)]
    layer_ops.rope_write_kv_torch(reference, positions, cos, sin, caches[0], caches[1], slots, HEADS)
    got = [torch.zeros(64, KV_HEADS, HEAD_DIM, dtype=cache_dtype) for _ in range(2)]
    layer_ops.rope_write_kv(qkv, positions, cos, sin, got[0], got[1], slots, HEADS)
    assert torch.equal(qkv, reference.to(BF16))
    assert torch.equal(got[0], caches[0].to(cache_dtype)) and torch.equal(got[1], caches[1].to(cache_dtype))


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("ctx_lens", [[1, 16, 17, 250], [37, 3], [1000], [130, 600]])
def test_paged_decode_attention_matches_sdpa(ctx_lens, threads):
    """A step of few rows splits each row's positions over the threads and merges the
    parts: a row alone on 1-4 threads, two rows on 4, against the whole softmax."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_decode_attention(ctx_lens)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 1), (4, 4)])
def test_paged_decode_attention_other_blocks_and_groups(block_size, heads, kv_heads):
    """Blocks of other sizes than 16 positions (steps within a block, or shorter than 16) and
    other query heads per KV head (1 to 8), against the whole softmax."""
    check_decode_attention([1, 15, 33, 300], block_size, heads, kv_heads)


def check_decode_attention(ctx_lens, block_size=BLOCK, heads=HEADS, kv_heads=KV_HEADS):
    num_blocks = 128 * BLOCK // block_size
    k_cache = randn(num_blocks * block_size, kv_heads, HEAD_DIM, seed=1)
    v_cache = randn(num_blocks * block_size, kv_heads, HEAD_DIM, seed=2)
    width = max(-(-n // block_size) for n in ctx_lens)
    # Scattered, non-contiguous blocks, padded with block 0 as the runner pads.
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.long)
    used = 0
    for b, n in enumerate(ctx_lens):
        k = -(-n // block_size)
        tables[b, :k] = perm[used:used + k]
        used += k
    q = randn(len(ctx_lens), heads, HEAD_DIM, seed=4) * 4  # peaky softmax
    lens = torch.tensor(ctx_lens)
    got = layer_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size)
    expected = layer_ops.paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, block_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def test_paged_decode_attention_reads_a_bfloat16_cache():
    """A bfloat16 KV cache (--kv-cache-dtype) read as float32: the PyTorch version on the
    same rounded values, within float32 summation noise."""
    k_cache = randn(8 * BLOCK, KV_HEADS, HEAD_DIM, seed=1).to(BF16)
    v_cache = randn(8 * BLOCK, KV_HEADS, HEAD_DIM, seed=2).to(BF16)
    tables, lens = torch.tensor([[3, 1, 6], [0, 2, 2]]), torch.tensor([40, 20])
    q = randn(2, HEADS, HEAD_DIM, seed=4) * 4
    got = layer_ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, BLOCK)
    expected = layer_ops.paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, BLOCK)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


def test_bad_arguments_raise_instead_of_reading_out_of_bounds():
    q, cache = randn(1, HEADS, HEAD_DIM), randn(4 * BLOCK, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="outside the cache"):
        layer_ops.paged_decode_attention(q, cache, cache, torch.tensor([[9]]), torch.tensor([5]), BLOCK)
    with pytest.raises(RuntimeError, match="outside its block table"):
        layer_ops.paged_decode_attention(q, cache, cache, torch.tensor([[1]]), torch.tensor([17]), BLOCK)
    qkv = randn(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    with pytest.raises(RuntimeError, match="out of range"):
        layer_ops.rope_write_kv(qkv, torch.tensor([0]), randn(8, HEAD_DIM), randn(8, HEAD_DIM), cache, cache,
                                torch.tensor([4 * BLOCK]), HEADS)
    with pytest.raises(RuntimeError, match="columns"):
        layer_ops.rope_write_kv(qkv, torch.tensor([0]), randn(8, HEAD_DIM), randn(8, HEAD_DIM), cache, cache,
                                torch.tensor([0]), HEADS + 1)


def test_model_with_kernels_matches_pytorch_operators(model_info, monkeypatch):
    """A prefill of 40 tokens and 8 decode steps: the same greedy tokens, logits within
    float32 summation noise, with the kernels and with the PyTorch operators."""
    model = LlamaModel.load(model_info.path, weight_format="q4_1")
    prompt = randn(40, seed=5).abs().mul(1000).long().tolist()

    def greedy():
        cache = model.allocate_kv_cache(8, BLOCK)
        table = torch.arange(8)
        tokens, logits_seen = list(prompt), []
        for step in range(9):
            start = 0 if step == 0 else len(tokens) - 1
            pos = torch.arange(start, len(tokens))
            ids = torch.tensor(tokens[start:])
            prefill = [PrefillSeq(0, len(pos), len(tokens), table)] if step == 0 else []
            decode = torch.tensor([] if step == 0 else [0])
            meta = AttentionMetadata(positions=pos, slot_mapping=pos, prefills=prefill, decode_rows=decode,
                                     decode_block_tables=table.view(1, -1)[: len(decode)],
                                     decode_ctx_lens=torch.tensor([len(tokens)])[: len(decode)],
                                     logits_rows=torch.tensor([len(pos) - 1]))
            logits = model.forward(ids, meta, cache)
            logits_seen.append(logits)
            tokens.append(int(logits.argmax()))
        return tokens, torch.cat(logits_seen)

    fused_tokens, fused_logits = greedy()
    monkeypatch.setattr(layer_ops, "fused", lambda x: False)
    monkeypatch.setattr(layer_ops, "fused_any", lambda *tensors: False)
    torch_tokens, torch_logits = greedy()
    assert fused_tokens == torch_tokens
    torch.testing.assert_close(fused_logits, torch_logits, rtol=1e-4, atol=1e-3)
