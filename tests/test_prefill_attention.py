"""Prefill attention on the CPU: each of the kernel's ways (``prefill_attention.cpp``) against
SDPA with an explicit causal mask over the gathered context, the choice between them by
measurement, and the kernel's refusals. The kernel's cases run where this CPU has AVX-512."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.model import kernels, prefill_attention, tuning

HEADS, KV_HEADS, BLOCK = 9, 3, 16
FLOAT32_WAYS = [w for w in prefill_attention.ways(torch.float32, HEADS, KV_HEADS, 64) if w != "sdpa"]
BFLOAT16_WAYS = [w for w in prefill_attention.ways(torch.bfloat16, HEADS, KV_HEADS, 64) if w != "sdpa"]
KERNEL_CASES = [(torch.float32, w) for w in FLOAT32_WAYS] + [(torch.bfloat16, w) for w in BFLOAT16_WAYS]
needs_kernel = pytest.mark.skipif(not KERNEL_CASES, reason="the prefill attention kernel needs AVX-512")


def reference(q, layer_cache, table, ctx_len, dtype):
    """SDPA with an explicit mask over the context gathered by hand, in float64."""
    q_len, kv = q.shape[0], layer_cache.shape[-2]
    k, v = (layer_cache[j][table].flatten(0, 1)[:ctx_len].to(dtype).double() for j in (0, 1))
    visible = torch.arange(ctx_len)[None, :] <= torch.arange(q_len)[:, None] + ctx_len - q_len
    o = F.scaled_dot_product_attention(q.to(dtype).double().transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], attn_mask=visible, enable_gqa=q.shape[1] != kv)
    return o[0].transpose(0, 1)


def pool(ctx_len: int, head_dim: int, cache_dtype: torch.dtype, seed: int = 0):
    """A layer's cache of 64 blocks of random K/V and a shuffled block table for ``ctx_len``."""
    gen = torch.Generator().manual_seed(seed)
    layer_cache = torch.randn(2, 64, BLOCK, KV_HEADS, head_dim, generator=gen).to(cache_dtype)
    table = torch.randperm(64, generator=gen)[: -(-ctx_len // BLOCK)]
    return layer_cache, table


@needs_kernel
@pytest.mark.parametrize("dtype,way", KERNEL_CASES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,ctx_len", [(1, 1), (5, 5), (33, 40), (286, 286), (100, 400), (7, 300), (70, 71)])
def test_kernel_matches_masked_sdpa(dtype, way, head_dim, q_len, ctx_len):
    for cache_dtype in (torch.float32, torch.bfloat16):
        layer_cache, table = pool(ctx_len, head_dim, cache_dtype)
        qkv = torch.randn(q_len, (HEADS + 2 * KV_HEADS) * head_dim).to(dtype)  # q: a strided view, as a step's
        q = qkv[:, : HEADS * head_dim].view(q_len, HEADS, head_dim)
        got = prefill_attention.attend(way, q, None, None, layer_cache, table, ctx_len, dtype)
        assert got.dtype == dtype and got.shape == (q_len, HEADS, head_dim)
        want = reference(q, layer_cache, table, ctx_len, dtype)
        # float32: the sums' order; bfloat16: P rounded to bfloat16 (as PyTorch's flash
        # attention rounds it) and the output's rounding, |out| < 4 here.
        tol = 2e-6 if dtype == torch.float32 else 3e-2
        assert (got.double() - want).abs().max().item() < tol


@needs_kernel
def test_sdpa_way_agrees_with_the_kernel_without_and_behind_cached_tokens():
    dtype, way = KERNEL_CASES[0]
    for q_len, ctx_len in ((64, 64), (48, 80)):
        layer_cache, table = pool(ctx_len, 64, dtype, seed=1)
        q = torch.randn(q_len, HEADS, 64).to(dtype)
        flat = [layer_cache[j][table].flatten(0, 1)[ctx_len - q_len: ctx_len] for j in (0, 1)]
        sdpa = prefill_attention.attend("sdpa", q, *flat, layer_cache, table, ctx_len, dtype)
        kernel = prefill_attention.attend(way, q, *flat, layer_cache, table, ctx_len, dtype)
        assert (sdpa.float() - kernel.float()).abs().max().item() < (2e-6 if dtype == torch.float32 else 3e-2)


@needs_kernel
def test_kernel_refuses_bad_arguments():
    layer_cache, table = pool(40, 64, torch.float32)
    k, v = layer_cache[0].flatten(0, 1), layer_cache[1].flatten(0, 1)
    q = torch.randn(8, HEADS, 64)
    op = torch.ops.epdserve.prefill_attention
    with pytest.raises(RuntimeError, match="isa must be"):
        op(q, k, v, table, 40, BLOCK, 0.125, "sse")
    with pytest.raises(RuntimeError, match="out of the cache"):
        op(q, k, v, torch.full_like(table, 64), 40, BLOCK, 0.125, "avx512")
    with pytest.raises(RuntimeError, match="ctx_len must cover"):
        op(q, k, v, table, 4, BLOCK, 0.125, "avx512")
    with pytest.raises(RuntimeError, match="ctx_len must cover"):
        op(q, k, v, table, 4000, BLOCK, 0.125, "avx512")
    with pytest.raises(RuntimeError, match="head_dim must be"):
        op(torch.randn(8, HEADS, 32), k[..., :32].contiguous(), v[..., :32].contiguous(), table, 40, BLOCK, 0.1,
           "avx512")
    with pytest.raises(RuntimeError, match="multiple"):
        op(torch.randn(8, 4, 64), k, v, table, 40, BLOCK, 0.125, "avx512")


def test_ways_fall_back_to_sdpa_where_the_kernel_cannot_run():
    assert prefill_attention.ways(torch.float16, HEADS, KV_HEADS, 64) == ["sdpa"]
    assert prefill_attention.ways(torch.float32, HEADS, KV_HEADS, 96) == ["sdpa"]
    assert prefill_attention.ways(torch.float32, 10, KV_HEADS, 64) == ["sdpa"]
    assert prefill_attention.measured_way(torch.float32, HEADS, KV_HEADS, 96) is None
    have = kernels.cpu_flags()
    assert ("avx512" in FLOAT32_WAYS) == (kernels.AVX512 <= have and kernels.available())


@needs_kernel
def test_a_way_the_kernel_refuses_is_not_offered(caplog):
    """A way whose CPU feature the OS withholds (AMX's tiles without Linux's permission) is
    refused by the kernel: it is probed once, logged, and left out of the measurement."""
    assert not prefill_attention._runs("sse")
    assert "the kernel's sse way does not run here" in caplog.text
    assert all(prefill_attention._runs(w) for w in FLOAT32_WAYS + BFLOAT16_WAYS)


@needs_kernel
def test_the_measured_way_is_kept_and_read_back(tmp_path, monkeypatch):
    kernels.available()  # (built under the real cache before it moves)
    monkeypatch.setenv("EPDSERVE_CACHE", str(tmp_path))
    dtype = KERNEL_CASES[0][0]
    first = prefill_attention.measured_way(dtype, HEADS, KV_HEADS, 64)
    assert first.source in (tuning.MEASURED, tuning.DISTURBED)
    assert first.value in prefill_attention.ways(dtype, HEADS, KV_HEADS, 64)
    assert first.path.is_relative_to(tmp_path / "tuning" / "prefill_attention")
    if first.source == tuning.MEASURED:
        again = prefill_attention.measured_way(dtype, HEADS, KV_HEADS, 64)
        assert (again.value, again.source) == (first.value, tuning.CACHE)
    forced = prefill_attention.measured_way(dtype, HEADS, KV_HEADS, 64, force=True)
    assert forced.source in (tuning.MEASURED, tuning.DISTURBED)
