"""A decoder layer's small operators: fused C++ kernels on the CPU (at batch 1 PyTorch's ~150 operators a
layer cost as much as the matmuls), Triton decode attention on CUDA, else the ``*_torch`` references."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from epdserve.model import kernels


def fused(x: torch.Tensor) -> bool:
    """float32 on the CPU with the kernels built: only then may :func:`decode_layer` run."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and kernels.available()


def fused_any(*tensors: torch.Tensor) -> bool:
    """float32 or bfloat16 on the CPU, kernels built (RMSNorm, SiLU x up, RoPE)."""
    return (all(t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" for t in tensors)
            and kernels.available())


def decode_layer(x: torch.Tensor, weights: tuple, layer_cache: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, num_heads: int, eps: float) -> None:
    """One decoder layer in one kernel call, all rows decode, only when :func:`fused`: ``x [B, hidden]`` float32
    in place; ``weights`` ``(input_norm, post_norm, qkv, qkv_bias or None, o, gate_up, down)`` as
    ``Linear.kernel_tensors`` gives them. Raises RuntimeError on a shape mismatch or an index out of range."""
    torch.ops.epdserve.decode_layer(x, *weights, layer_cache, positions, cos, sin, slot_mapping, block_tables,
                                    ctx_lens, num_heads, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` (Zhang & Sennrich, 2019) of ``x [T, H]`` in ``dtype`` (default ``x``'s).
    With ``delta [T, H]``, ``x`` is first updated in place to ``x + delta`` (one pass in the kernel)."""
    if fused_any(x, *([] if delta is None else [delta])) and x.shape[-1] % 8 == 0:
        return torch.ops.epdserve.rms_norm(x, weight, eps, dtype, delta)
    if delta is not None:
        x.add_(delta)
    return rms_norm_torch(x, weight, eps).to(dtype or x.dtype)


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` → ``[T, I]``; the kernel's sigmoid differs in the last bits."""
    if fused_any(gate_up) and gate_up.shape[-1] % 16 == 0:
        return torch.ops.epdserve.silu_mul(gate_up, dtype)
    return silu_mul_torch(gate_up).to(dtype or gate_up.dtype)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In transformers' order (float32 variance)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int) -> None:
    """Rotate-half RoPE (Su et al., 2021; transformers' ``apply_rotary_pos_emb``) in place on ``qkv [T, (heads +
    2 kv_heads) × head_dim]`` (contiguous q|k|v), then K/V into ``[slots, kv_heads, head_dim]`` caches at
    ``slot_mapping [T]``. Raises RuntimeError on a shape mismatch or an index out of range."""
    if fused_any(qkv, cos, k_cache) and k_cache.shape[-1] % 16 == 0:
        torch.ops.epdserve.rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    else:
        rope_write_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads)


def rope_write_kv_torch(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads) -> None:
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
    """PagedAttention (Kwon et al., SOSP 2023), one token per sequence: ``q [B, heads, head_dim]`` → the same,
    GQA; caches ``[slots, kv_heads, head_dim]`` read as ``q``'s dtype; ``block_tables [B, max_blocks]`` padded
    with any valid id. Raises RuntimeError (CPU) or ValueError (CUDA) on a mismatch."""
    if fused(q):
        return torch.ops.epdserve.paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens,
                                                         block_size, 1.0 / math.sqrt(q.shape[-1]))
    if q.is_cuda:
        # Imported here: Triton ships with CUDA builds of torch only, and CPU workers never need it.
        from epdserve.model import triton_attention
        return triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size)
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, ctx_lens, block_size)


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, ctx_lens, block_size) -> torch.Tensor:
    batch, max_ctx = block_tables.shape[0], block_tables.shape[1] * block_size
    ks, vs = (gather_blocks(cache.view(-1, block_size, *cache.shape[1:]), block_tables.flatten())
              .view(batch, max_ctx, *cache.shape[1:]).to(q.dtype) for cache in (k_cache, v_cache))  # [B, ctx, Hkv, D]
    mask = torch.arange(max_ctx, device=ctx_lens.device).unsqueeze(0) < ctx_lens.unsqueeze(1)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), ks.transpose(1, 2), vs.transpose(1, 2),
                                       attn_mask=mask[:, None, None, :], enable_gqa=True)
    return o.squeeze(2)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[n * block_size, kv_heads, head_dim]``; ``index_select``: advanced indexing is 3-4x slower here."""
    return torch.index_select(cache, 0, block_ids).flatten(0, 1)
