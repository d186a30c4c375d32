"""Causal prefill attention on the CPU, the way measured fastest here (``tuning.py``): the
``prefill_attention.cpp`` kernel (paged cache read in place; ``avx512``/``avx512_bf16``/``amx``, head_dim 64
or 128) or ``sdpa``. 2-core AMX Xeon, SmolLM2-135M, 286 tokens, a layer: avx512 0.65 ms vs sdpa 1.10."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from epdserve.model import kernels, layer_ops, tuning

log = logging.getLogger(__name__)

SDPA = "sdpa"
# What each of the kernel's ways needs (/proc/cpuinfo's names), per compute dtype.
ISA = {torch.float32: {"avx512": kernels.AVX512},
       torch.bfloat16: {"amx": kernels.AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"},
                        "avx512_bf16": kernels.AVX512 | {"avx512_bf16"}}}
TIMED_TOKENS, TIMED_CALLS = 256, 10  # the measured prefill: a prompt's length, calls per round


def ways(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> list[str]:
    """The ways a prefill computed in ``dtype`` can run here for this head layout, :data:`SDPA` last."""
    fits = head_dim in (64, 128) and heads % kv_heads == 0 and heads // kv_heads <= 8
    isas = [isa for isa, needs in ISA.get(dtype, {}).items() if needs <= kernels.cpu_flags()]
    return [isa for isa in isas if fits and kernels.available() and _runs(isa)] + [SDPA]


@functools.cache
def _runs(isa: str) -> bool:
    """The CPU may list a feature the OS withholds (AMX tiles need Linux's permission); logs when not."""
    try:
        cache = torch.zeros(2, 1, 16, 1, 64)
        attend(isa, torch.zeros(1, 1, 64), None, None, cache, torch.zeros(1, dtype=torch.long), 1, torch.float32)
    except RuntimeError as exc:
        log.warning("prefill attention: the kernel's %s way does not run here (%s); measuring the others", isa,
                    str(exc).splitlines()[0])
        return False
    return True


def measured_way(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                 force: bool = False) -> tuning.Tuned | None:
    """None where only :data:`SDPA` runs; timed on :data:`TIMED_TOKENS` tokens, nothing cached."""
    candidates = ways(dtype, heads, kv_heads, head_dim)
    if candidates == [SDPA]:
        return None
    gen = torch.Generator().manual_seed(0)
    t, block_size = TIMED_TOKENS, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = (part.view(t, -1, head_dim) for part in qkv.split([heads * head_dim, *[kv_heads * head_dim] * 2], -1))
    layer_cache = torch.stack([k, v]).view(2, t // block_size, block_size, kv_heads, head_dim).contiguous()
    table = torch.arange(t // block_size)

    def timed(way: str):
        return lambda: [attend(way, q, k, v, layer_cache, table, t, dtype) for _ in range(TIMED_CALLS)]

    key = [heads, kv_heads, head_dim, str(dtype)]
    return tuning.choose("prefill_attention", key, lambda: tuning.time_rounds({w: timed(w) for w in candidates}),
                         lambda seconds: min(candidates, key=seconds.__getitem__), candidates.__contains__, force)


def attend(way: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_cache: torch.Tensor,
           block_table: torch.Tensor, ctx_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``q``/``k``/``v [q_len, heads or kv_heads, head_dim]`` (strided rows allowed; K/V already cached) →
    ``[q_len, heads, head_dim]`` in ``dtype``; query i sees ``ctx_len - q_len + i + 1`` positions."""
    if way != SDPA:  # (the kernel computes in float32 on avx512, else in bfloat16: dtype)
        k_cache, v_cache = layer_cache[0].flatten(0, 1), layer_cache[1].flatten(0, 1)
        return torch.ops.epdserve.prefill_attention(q, k_cache, v_cache, block_table, ctx_len, layer_cache.shape[2],
                                                    q.shape[-1] ** -0.5, way)
    if ctx_len == q.shape[0]:
        qs, ks, vs = (x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, v))  # [1, H, q, D]
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    return gathered_prefill_attention(q, layer_cache, block_table, ctx_len, dtype)


def gathered_prefill_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_table: torch.Tensor,
                               ctx_len: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Behind cached tokens: ``ctx_len`` positions gathered into one copy, then SDPA in ``dtype`` (None: ``q``'s);
    ``q [q_len, heads, head_dim]`` → the same shape. On CUDA, Triton reads the pool in place instead."""
    q_len = q.shape[0]
    cached = ctx_len - q_len
    dtype = dtype or q.dtype
    qs = q.transpose(0, 1).unsqueeze(0).to(dtype)  # [1, H, q_len, D]
    ks, vs = (layer_ops.gather_blocks(layer_cache[j], block_table)[:ctx_len].to(dtype) for j in (0, 1))
    if cached < q_len:
        # Zero queries pad the front so is_causal applies: an explicit mask computes both halves (1.5-1.9x).
        qs, mask = torch.cat([qs.new_zeros(1, qs.shape[1], cached, qs.shape[3]), qs], dim=2), None
    else:
        q_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + cached
        mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= q_pos
    o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                                       attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return o[0, :, -q_len:].transpose(0, 1)
