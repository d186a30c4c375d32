"""The small operators of a decoder layer: RMSNorm, SiLU x up, RoPE with the KV cache
write, and attention of decode tokens over the paged KV cache.

Each runs the fused C++ kernel (``layer_kernels.cpp``) on the CPU when the kernels are built
(``kernels.available()``): RMSNorm, SiLU x up and RoPE for float32 and bfloat16 tensors
(their results in either: a float32 model's norm feeds bfloat16 GEMMs without a cast),
decode attention for float32; else its PyTorch version (``*_torch``: the fallback for
other dtypes and CPUs without AVX2, and the tests' reference); on CUDA, decode
attention runs the Triton kernel of ``triton_attention`` and the rest the PyTorch versions. At decode
batch 1 the PyTorch versions cost SmolLM2-135M about as much time as its weight matmuls
(~150 operators per layer, a few microseconds of dispatch each); the kernels are four.
The maths follows transformers' ``modeling_llama``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from epdserve.model import kernels


def fused(x: torch.Tensor) -> bool:
    """Whether the kernels run for tensors like ``x`` (float32 on the CPU, kernels built);
    else the PyTorch versions do, and :func:`decode_layer` must not be called. (The device
    is checked first: a CUDA worker never builds the CPU kernels.)"""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernels.available()


def fused_any(*tensors: torch.Tensor) -> bool:
    """Whether the float32-or-bfloat16 kernels (RMSNorm, SiLU x up, RoPE) run for ``tensors``:
    each float32 or bfloat16 on the CPU, kernels built."""
    return (all(t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" for t in tensors)
            and kernels.available())


def decode_layer(x: torch.Tensor, weights: tuple, layer_cache: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, num_heads: int, eps: float) -> None:
    """One whole decoder layer, in one kernel call, for a step whose every row is one
    decode token (``LlamaModel.forward``'s per-layer code with :func:`rms_norm`,
    :func:`rope_write_kv` and :func:`paged_decode_attention`); only when :func:`fused`.

    Args:
        x: ``[B, hidden]`` float32, updated in place.
        weights: ``(input_norm [hidden], post_norm [hidden], qkv, qkv_bias or None, o,
            gate_up, down)``, each projection as ``linear.Linear.kernel_tensors`` gives it.
        layer_cache: ``[2, num_blocks, block_size, kv_heads, head_dim]``; the other
            arguments as :func:`rope_write_kv` and :func:`paged_decode_attention` take them.
    Raises:
        RuntimeError: shapes disagree, or a position, slot or block is out of range.
    """
    torch.ops.epdserve.decode_layer(x, *weights, layer_cache, positions, cos, sin, slot_mapping, block_tables,
                                    ctx_lens, num_heads, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x², -1) + eps))`` for ``x [T, H]``, ``weight [H]``
    (transformers' ``LlamaRMSNorm``; Zhang & Sennrich, 2019), in ``dtype`` (default
    ``x``'s: the kernel writes it directly, the PyTorch version casts). With ``delta [T, H]``
    (a residual branch's output), ``x`` is first updated in place to ``x + delta`` (in its
    dtype, as ``add_``): the kernel does both in one pass over the rows."""
    if fused_any(x, *([] if delta is None else [delta])) and x.shape[-1] % 8 == 0:
        return torch.ops.epdserve.rms_norm(x, weight, eps, dtype, delta)
    if delta is not None:
        x.add_(delta)
    return rms_norm_torch(x, weight, eps).to(dtype or x.dtype)


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate the first ``I`` columns),
    ``[T, I]`` in ``dtype`` (default ``gate_up``'s). The kernel's sigmoid differs from
    PyTorch's in the last bits, as RMSNorm's sum does."""
    if fused_any(gate_up) and gate_up.shape[-1] % 16 == 0:
        return torch.ops.epdserve.silu_mul(gate_up, dtype)
    return silu_mul_torch(gate_up).to(dtype or gate_up.dtype)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul` in PyTorch."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` in PyTorch, in transformers' order (float32 variance)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int) -> None:
    """Rotate-half RoPE (Su et al., 2021, as transformers' ``apply_rotary_pos_emb``) on the
    query and key heads of ``qkv`` in place, then write each row's keys and values into
    the KV cache.

    Args:
        qkv: ``[T, (num_heads + 2 kv_heads) × head_dim]``, contiguous: each row's query,
            key and value heads, in that order (float32 or bfloat16: the kernel computes in
            float32 and writes the caches from those values).
        positions: ``[T]`` int64 token positions, rows of ``cos`` / ``sin``
            (``[max_positions, head_dim]``, the model's dtype).
        k_cache, v_cache: one layer's ``[slots, kv_heads, head_dim]``, float32 or bfloat16.
        slot_mapping: ``[T]`` int64 slot of each row's K/V.
    Raises:
        RuntimeError: shapes disagree, or a position or slot is out of range.
    """
    if fused_any(qkv, cos, k_cache) and k_cache.shape[-1] % 16 == 0:
        torch.ops.epdserve.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    else:
        rope_write_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads)


def rope_write_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads) -> None:
    """:func:`rope_write_kv` in PyTorch."""
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    q, k, v = (part.view(len(qkv), -1, d) for part in qkv.split([num_heads * d, kv_heads * d, kv_heads * d], dim=-1))
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x in (q, k):
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        x.copy_(x * c + rotated * s)
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of one new token per sequence over its KV blocks (PagedAttention, Kwon et
    al., SOSP 2023), scale ``1/sqrt(head_dim)``, grouped-query heads (query head h reads
    KV head ``h // (heads / kv_heads)``).

    On CUDA the Triton kernel runs (``triton_attention.paged_decode_attention``: blocks
    read in place, split-K for long contexts); on the CPU the C++ kernel, else the PyTorch
    version (which gathers the blocks).

    Args:
        q: ``[B, heads, head_dim]``.
        k_cache, v_cache: one layer's ``[slots, kv_heads, head_dim]``; slot = block id ×
            ``block_size`` + offset; float32 or bfloat16 (``--kv-cache-dtype``), read as
            ``q``'s dtype.
        block_tables: ``[B, max_blocks]`` int64, padded with any valid block id.
        ctx_lens: ``[B]`` int64 positions attended (the new token's included).
    Returns:
        ``[B, heads, head_dim]``.
    Raises:
        RuntimeError: shapes disagree, or a context outruns its block table or the cache
            (CPU); ValueError: shapes or dtypes disagree (CUDA).
    """
    if fused(q):
        return torch.ops.epdserve.paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens,
                                                         block_size, 1.0 / math.sqrt(q.shape[-1]))
    if q.is_cuda:
        # Imported here: Triton ships with CUDA builds of torch only, and CPU workers never need it.
        from epdserve.model import triton_attention
        return triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, ctx_lens, block_size)


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, ctx_lens, block_size) -> torch.Tensor:
    """:func:`paged_decode_attention` in PyTorch: gather the blocks, mask, SDPA."""
    batch, max_ctx = block_tables.shape[0], block_tables.shape[1] * block_size
    ks, vs = (gather_blocks(cache.view(-1, block_size, *cache.shape[1:]), block_tables.flatten())
              .view(batch, max_ctx, *cache.shape[1:]).to(q.dtype) for cache in (k_cache, v_cache))  # [B, ctx, Hkv, D]
    mask = torch.arange(max_ctx, device=ctx_lens.device).unsqueeze(0) < ctx_lens.unsqueeze(1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], enable_gqa=True)
    return o.squeeze(2)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The tokens of ``block_ids [n]`` from one layer's K or V cache ``[num_blocks,
    block_size, kv_heads, head_dim]``, in order: ``[n * block_size, kv_heads, head_dim]``.

    ``index_select`` copies whole blocks; advanced indexing (``cache[ids]``) goes through
    the generic index kernel and is 3-4x slower at decode batch 32 on this CPU.
    """
    return torch.index_select(cache, 0, block_ids).flatten(0, 1)
