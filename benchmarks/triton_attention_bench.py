"""The Triton paged-attention kernels (:mod:`epdserve.model.triton_attention`) timed against
the PyTorch paths they replace, on the same random paged pools: decode attention against
``layer_ops.paged_decode_attention_torch`` (gathering the blocks), a prefill behind cached
tokens against gathering the blocks, then SDPA (the CPU's way). Imported by
``benchmarks/gpu_check.py``; on the CPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``), as ``tests/test_triton_attention.py`` runs them.
"""

from __future__ import annotations

import time

import torch

from epdserve.model import layer_ops, triton_attention
from epdserve.model.prefill_attention import gathered_prefill_attention


def benchmark_decode_attention(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                               dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                               block_size: int = 16, iters: int = 20, seed: int = 0) -> dict:
    """Time decode attention over a paged pool, the Triton kernel against the gathering
    PyTorch path (``layer_ops.paged_decode_attention_torch``), on the same random inputs:
    ``batch`` sequences of ``ctx`` tokens each, blocks scattered over the pool.

    Both are timed over ``iters`` calls after 3 warm-up calls (the device synchronized
    around each run; on the CPU, e.g. under ``TRITON_INTERPRET=1``, wall-clock time).
    Returns a dict: ``triton_ms`` / ``torch_ms`` (per call), ``triton_gbps`` / ``torch_gbps``
    (the K/V bytes a call must read, ``kv_bytes``, over its time: 1e9 bytes/s),
    ``splits`` (:func:`~epdserve.model.triton_attention.decode_splits`' choice), ``max_abs_diff`` between the two outputs,
    and the arguments. Raises ValueError as :func:`~epdserve.model.triton_attention.paged_decode_attention`.
    """
    device = torch.device(device)
    k_cache, v_cache, block_tables, gen = _random_pool(batch, ctx, kv_heads, head_dim, dtype, device, block_size,
                                                       seed)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.long, device=device)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(device, dtype)
    result = _compare(lambda: triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size),
                      lambda: layer_ops.paged_decode_attention_torch(q, k_cache, v_cache, block_tables, ctx_lens,
                                                                     block_size),
                      2 * batch * ctx * kv_heads * head_dim * k_cache.element_size(), iters, device)
    splits = triton_attention.decode_splits(batch, kv_heads, block_tables.shape[1] * block_size,
                                            triton_attention.device_programs(device))
    return {"batch": batch, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device), "block_size": block_size,
            "splits": splits, **result}


def benchmark_prefill_attention(q_len: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                                dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                                block_size: int = 16, iters: int = 10, seed: int = 0) -> dict:
    """Time one sequence's prefill of ``q_len`` tokens behind ``ctx - q_len`` cached ones,
    :func:`~epdserve.model.triton_attention.paged_prefill_attention` (the pool read in place) against gathering the blocks,
    then SDPA (``prefill_attention.gathered_prefill_attention``, the CPU's way), as
    :func:`benchmark_decode_attention` times them. Returns its keys (``kv_bytes``: the
    context's K/V once) plus ``q_len`` and ``tflops`` of each (the causal half of
    ``4 × q_len × ctx × heads × head_dim`` flops). Raises ValueError for ``q_len >= ctx``.
    """
    if not 0 < q_len < ctx:
        raise ValueError(f"q_len {q_len} must be in [1, ctx {ctx}): a prefill behind cached tokens")
    device = torch.device(device)
    k_cache, v_cache, block_tables, gen = _random_pool(1, ctx, kv_heads, head_dim, dtype, device, block_size, seed)
    layer_cache = torch.stack([k_cache, v_cache]).view(2, -1, block_size, kv_heads, head_dim)
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(device, dtype)
    result = _compare(lambda: triton_attention.paged_prefill_attention(q, k_cache, v_cache, block_tables[0], ctx, block_size),
                      lambda: gathered_prefill_attention(q, layer_cache, block_tables[0], ctx),
                      2 * ctx * kv_heads * head_dim * k_cache.element_size(), iters, device)
    flops = 2 * q_len * (2 * ctx - q_len) * heads * head_dim  # the visible (causal) scores, QK and PV
    result.update(triton_tflops=flops / result["triton_ms"] / 1e9, torch_tflops=flops / result["torch_ms"] / 1e9)
    return {"q_len": q_len, "ctx": ctx, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "device": str(device), "block_size": block_size, **result}


def _random_pool(batch, ctx, kv_heads, head_dim, dtype, device, block_size, seed):
    """K and V caches of ``batch × ceil(ctx / block_size)`` blocks, scattered block tables,
    and the generator for the rest."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    k_cache, v_cache = (torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
                        for _ in range(2))
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(device)
    return k_cache, v_cache, block_tables, gen


def _compare(triton_fn, torch_fn, kv_bytes: int, iters: int, device: torch.device) -> dict:
    def timed(fn) -> tuple[float, torch.Tensor]:
        for _ in range(3):
            out = fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            out = fn()
        _sync(device)
        return (time.perf_counter() - start) * 1e3 / iters, out

    triton_ms, triton_out = timed(triton_fn)
    torch_ms, torch_out = timed(torch_fn)
    return {"kv_bytes": kv_bytes, "triton_ms": triton_ms, "torch_ms": torch_ms,
            "triton_gbps": kv_bytes / triton_ms / 1e6, "torch_gbps": kv_bytes / torch_ms / 1e6,
            "max_abs_diff": (triton_out.float() - torch_out.float()).abs().max().item()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
