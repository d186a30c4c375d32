"""KV blocks ``[layers, 2, n_blocks, block_size, kv_heads, head_dim]`` in a frame (``--kv-transfer-dtype``):
tensor ``kv`` in the cache's dtype (none), bfloat16 (bf16), or int8 plus ``scales [layers, 2, n_blocks,
block_size, kv_heads]`` float32 (symmetric per token and head, ``scale = max|x| / 127``, as KIVI / vLLM)."""

from __future__ import annotations

import torch

from epdserve.transfer.wire import TensorSpec, WireError

TRANSFER_DTYPES = ("none", "bf16", "int8")
_WIRE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_QMAX = 127.0


def specs(shape: list[int], cache_dtype: torch.dtype, transfer_dtype: str) -> list[TensorSpec]:
    """Raises ValueError for an unknown ``transfer_dtype``."""
    if transfer_dtype == "none":
        return [TensorSpec(name="kv", dtype=_WIRE_NAMES[cache_dtype], shape=shape)]
    if transfer_dtype == "bf16":
        return [TensorSpec(name="kv", dtype="bfloat16", shape=shape)]
    if transfer_dtype == "int8":
        return [TensorSpec(name="kv", dtype="int8", shape=shape),
                TensorSpec(name="scales", dtype="float32", shape=shape[:-1])]
    raise ValueError(f"unknown KV transfer dtype {transfer_dtype!r} (choose from {', '.join(TRANSFER_DTYPES)})")


def encode(blocks: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """A cast for none/bf16, quantization for int8."""
    if "scales" not in out:
        out["kv"].copy_(blocks)
        return
    x = blocks.float()
    scales = x.abs().amax(dim=-1) / _QMAX
    # An all-zero head gets scale 1 instead of 0, so the division below stays finite.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    out["kv"].copy_(torch.round(x / safe.unsqueeze(-1)).clamp_(-_QMAX, _QMAX))
    out["scales"].copy_(scales)


def decode(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """No copy when already in ``dtype``. Raises WireError for a layout not of :func:`specs`."""
    kv = tensors.get("kv")
    if kv is None or set(tensors) - {"kv", "scales"}:
        raise WireError(f"a KV frame holds 'kv' (and 'scales' for int8), not {sorted(tensors)}")
    if kv.dtype != torch.int8:
        if "scales" in tensors:
            raise WireError(f"a {kv.dtype} KV frame has no scales")
        return kv.to(dtype)
    scales = tensors.get("scales")
    if scales is None or scales.dtype != torch.float32 or scales.shape != kv.shape[:-1]:
        raise WireError(f"int8 KV {tuple(kv.shape)} needs float32 scales of shape {tuple(kv.shape[:-1])}")
    return (kv.to(torch.float32) * scales.unsqueeze(-1)).to(dtype)
