"""How KV blocks are stored in a wire frame: as the cache holds them, as bfloat16, or as
int8 with scales (``--kv-transfer-dtype none|bf16|int8``).

KV blocks are ``[layers, 2 (K, V), n_blocks, block_size, kv_heads, head_dim]``. A frame
holds tensor ``kv`` of that shape, in the cache's dtype (none), in bfloat16 (bf16), or in
int8 (int8) plus tensor ``scales [layers, 2, n_blocks, block_size, kv_heads]`` float32:
symmetric quantization with one scale per (layer, K/V, token, kv head), i.e. per-token,
per-head scales, ``scale = max|x| / 127`` over the head's ``head_dim`` values and
``x ≈ q * scale`` (as in KIVI / vLLM's per-token KV quantization).
"""

from __future__ import annotations

import torch

from epdserve.transfer.wire import TensorSpec, WireError

TRANSFER_DTYPES = ("none", "bf16", "int8")
_WIRE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_QMAX = 127.0


def specs(shape: list[int], cache_dtype: torch.dtype, transfer_dtype: str) -> list[TensorSpec]:
    """The tensors of a frame holding KV blocks of ``shape`` from a cache of ``cache_dtype``.

    Raises:
        ValueError: an unknown ``transfer_dtype``.
    """
    if transfer_dtype == "none":
        return [TensorSpec(name="kv", dtype=_WIRE_NAMES[cache_dtype], shape=shape)]
    if transfer_dtype == "bf16":
        return [TensorSpec(name="kv", dtype="bfloat16", shape=shape)]
    if transfer_dtype == "int8":
        return [TensorSpec(name="kv", dtype="int8", shape=shape),
                TensorSpec(name="scales", dtype="float32", shape=shape[:-1])]
    raise ValueError(f"unknown KV transfer dtype {transfer_dtype!r} (choose from {', '.join(TRANSFER_DTYPES)})")


def encode(blocks: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Write ``blocks`` (KV blocks, any float dtype) into a frame's tensors ``out`` as laid
    out by :func:`specs`: a cast for none/bf16, quantization for int8."""
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
    """The KV blocks of a frame's ``tensors`` in ``dtype`` (no copy when the frame already
    holds them in ``dtype``).

    Raises:
        WireError: tensors that are not one of the layouts of :func:`specs`.
    """
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
