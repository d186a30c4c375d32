"""Paged attention on CUDA in Triton, K/V read in place through the block table: decode (split-K, Dao et
al., 2023) and prefill behind a cached prefix, one kernel as vLLM's ``triton_unified_attention``, online
softmax in float32. Split counts use host-known shapes only: no GPU wait, CUDA graphs replay. Import only
on CUDA paths; ``TRITON_INTERPRET=1`` runs it on CPU tensors (the tests)."""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

# Context tokens per kernel tile; a multiple of any power-of-two block size up to it.
BLOCK_N = 32
# Decode programs below which the context is split: ~one wave of an H100's 132 SMs (device unknown).
DEFAULT_PROGRAMS = 132
# Shorter splits cost more in the merge than their parallelism returns.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Query rows per prefill program (query tokens × heads of a group).
PREFILL_BLOCK_M = 64
LOG2E = 1.4426950408889634
# Triton 3.9's interpreter multiplies bfloat16 tl.dot tiles as raw integers: widened to float32 there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# Lengths are not specialised on: new variants would compile (seconds each) in the serving path.
@triton.jit(do_not_specialize=["q_len_arg", "ctx_len_arg"])
def _paged_attention_kernel(  # long: one kernel, its arguments and its online-softmax loop
        Q, K, V, Out, BlockTables, CtxLens, PartAcc, PartM, PartL,
        qk_scale, q_len_arg, ctx_len_arg, block_size,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
        stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DECODE: tl.constexpr, SPLIT: tl.constexpr, F32_DOTS: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1) % NUM_KV_HEADS
    q_tile = tl.program_id(1) // NUM_KV_HEADS
    split = tl.program_id(2)
    if DECODE:  # sequence `seq` is query row `seq`, one token; its context length on the device
        q_start = seq
        q_len = 1
        ctx_len = tl.load(CtxLens + seq).to(tl.int32)
    else:  # one sequence, `q_len_arg` query rows, the last ones of its `ctx_len_arg` positions
        q_start = 0
        q_len = q_len_arg
        ctx_len = ctx_len_arg
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F32_DOTS:
        q = q.to(tl.float32)
    # Causal: query token i (of q_len) sees positions up to ctx_len - q_len + i.
    limit = ctx_len - q_len + q_idx
    if DECODE:
        tokens_per_split = tl.cdiv(tl.cdiv(ctx_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        start = split * tokens_per_split
        end = tl.minimum(ctx_len, start + tokens_per_split)
    else:
        start = 0
        end = ctx_len - q_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(BlockTables + seq * stride_bt + pos // block_size, mask=pos_ok, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        if F32_DOTS:  # full float32 products (no TF32), as the CPU's float32 maths
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(pos_ok[None, :] & (pos[None, :] <= limit[:, None]), s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no visible key in this tile (and none before) keeps m = -inf: shift by 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOTS:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if SPLIT:  # decode only: row r is head kvh * GROUP + r
        part = seq * stride_pa_b + head * stride_pa_h + split * stride_pa_s
        tl.store(PartAcc + part[:, None] + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        stat = seq * stride_pm_b + head * stride_pm_h + split
        tl.store(PartM + stat, m_i, mask=row_ok)
        tl.store(PartL + stat, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(PartAcc, PartM, PartL, Out, num_splits,
                         stride_pa_b, stride_pa_h, stride_pa_s, stride_pm_b, stride_pm_h, stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    stat = seq * stride_pm_b + head * stride_pm_h + s
    m = tl.load(PartM + stat, mask=s_ok, other=float("-inf"))
    l_part = tl.load(PartL + stat, mask=s_ok, other=0.0)
    # Split 0 always holds position 0 (a context has at least one token): m_max is finite.
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    acc = tl.load(PartAcc + seq * stride_pa_b + head * stride_pa_h + s[:, None] * stride_pa_s + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_part * w, 0)
    tl.store(Out + seq * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def decode_splits(batch: int, kv_heads: int, max_ctx: int, programs: int | None = None) -> int:
    """Split-K parts: 1 if ``batch × kv_heads`` fills ``programs`` (SMs) or ``max_ctx`` (tokens) is under ``2 ×
    MIN_SPLIT_TOKENS``; else enough to fill ``programs``, at most ``max_ctx // MIN_SPLIT_TOKENS`` and
    :data:`MAX_SPLITS`."""
    programs = programs or DEFAULT_PROGRAMS
    base = batch * kv_heads
    if base >= programs or max_ctx < 2 * MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(-(-programs // base), max_ctx // MIN_SPLIT_TOKENS, MAX_SPLITS))


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; a head_dim that is not a power of two is padded.
    return max(16, triton.next_power_of_2(head_dim))


@functools.cache
def device_programs(device: torch.device) -> int | None:
    """Asked once per device; None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> tuple[int, int]:
    """``(kv_heads, group)``; ValueError naming what disagrees."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} must be [rows, heads, head_dim] and k/v caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)} equal [slots, kv_heads, head_dim]")
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or heads % kv_heads:
        raise ValueError(f"q has {heads} heads of {head_dim}; the cache {kv_heads} KV heads of {k_cache.shape[2]} "
                         "(heads must be a multiple of KV heads, head sizes equal)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float32, torch.bfloat16,
                                                                          torch.float16):
        raise ValueError(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}: must be one of "
                         "float32, bfloat16, float16, all the same")
    if block_size < 1 or k_cache.shape[0] % block_size:
        raise ValueError(f"block_size {block_size} must divide the cache's {k_cache.shape[0]} slots")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("q and the caches need a contiguous head_dim")
    return kv_heads, heads // kv_heads


def _launch(grid, q, k_cache, v_cache, out, block_table, ctx_lens, parts, q_len, ctx_len, block_size,
            block_m, block_q, decode, split):
    kv_heads, group = k_cache.shape[1], q.shape[1] // k_cache.shape[1]
    acc, m, l_part = parts
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, ctx_lens, acc, m, l_part,
        LOG2E / math.sqrt(q.shape[-1]), q_len, ctx_len, block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0) if block_table.dim() == 2 else 0,
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        NUM_KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=q.shape[-1], BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N, BLOCK_D=_block_d(q.shape[-1]), DECODE=decode, SPLIT=split,
        F32_DOTS=q.dtype == torch.float32 or INTERPRETED)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int,
                           num_splits: int | None = None) -> torch.Tensor:
    """``layer_ops.paged_decode_attention`` in Triton (float32/bfloat16/float16, head_dim contiguous);
    ``ctx_lens [B]`` each in 1..max_blocks × block_size, unchecked (that would wait for the device). Raises
    ValueError on a mismatch."""
    kv_heads, group = _check(q, k_cache, v_cache, block_size)
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or ctx_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [{batch}, max_blocks] and ctx_lens "
                         f"{tuple(ctx_lens.shape)} [{batch}] for q {tuple(q.shape)}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    splits = num_splits or decode_splits(batch, kv_heads, block_tables.shape[1] * block_size,
                                         device_programs(q.device))
    block_m = max(16, triton.next_power_of_2(group))
    if splits == 1:
        parts = (out.new_empty(0, 0, 0, dtype=torch.float32), *(out.new_empty(0, 0, dtype=torch.float32),) * 2)
    else:
        head_dim = q.shape[-1]
        parts = (torch.empty(batch, q.shape[1], splits, head_dim, device=q.device, dtype=torch.float32),
                 torch.empty(batch, q.shape[1], splits, device=q.device, dtype=torch.float32),
                 torch.empty(batch, q.shape[1], splits, device=q.device, dtype=torch.float32))
    _launch((batch, kv_heads, splits), q, k_cache, v_cache, out, block_tables, ctx_lens, parts, 1, 0,
            block_size, block_m, 1, True, splits > 1)
    if splits > 1:
        acc, m, l_part = parts
        _merge_splits_kernel[(batch, q.shape[1])](
            acc, m, l_part, out, splits, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
            out.stride(0), out.stride(1), HEAD_DIM=q.shape[-1], BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=_block_d(q.shape[-1]))
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Causal: query i of ``q [q_len, heads, head_dim]`` sees positions ``≤ ctx_len - q_len + i`` (``ctx_len``
    a host int; new K/V already in the pool). Raises ValueError on a mismatch."""
    kv_heads, group = _check(q, k_cache, v_cache, block_size)
    q_len = q.shape[0]
    if block_table.dim() != 1 or not 1 <= q_len <= ctx_len <= block_table.shape[0] * block_size:
        raise ValueError(f"q_len {q_len}, ctx_len {ctx_len} and block_table {tuple(block_table.shape)} "
                         f"(block_size {block_size}) must satisfy 1 <= q_len <= ctx_len <= blocks × block_size")
    out = torch.empty_like(q)
    block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    parts = (out.new_empty(0, 0, 0, dtype=torch.float32), *(out.new_empty(0, 0, dtype=torch.float32),) * 2)
    _launch((1, kv_heads * -(-q_len // block_q), 1), q, k_cache, v_cache, out, block_table, block_table, parts,
            q_len, ctx_len, block_size, block_m, block_q, False, False)
    return out
