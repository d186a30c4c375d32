"""GGUF weight blocks for ``quant_mm`` (``x @ W^T`` from the blocks): a Q4_1 block is 32 weights in 24 bytes
as loaded (float32 d and m; llama.cpp's fp16: 20), 20 in bit planes (:func:`to_planes`); the loader's float32
weights are exactly ``d * q + m``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from epdserve.model import kernels

BLOCK = 32  # weights per block along K, ggml's QK4_1 and QK8_0
BLOCKS_FILE = Path("quantized") / "blocks.safetensors"  # inside a GGUF-converted model dir


@dataclass(frozen=True)
class Blocks:
    """``W [N, K]`` in blocks of 32 along K. ``qs``: Q4_1 ``uint8 [N, K/32, 16]`` (byte j: q[j] low nibble,
    q[j+16] high, ggml's ``block_q4_1``; w = d * q + m) or Q8_0 ``int8 [N, K/32, 32]`` (w = d * q);
    ``scales`` (d), ``mins`` (m, Q4_1 only): float32 ``[N, K/32]``. Or Q4_1 in bit planes (:func:`to_planes`):
    ``qs`` ``int32 [N/16, K/32, 4, 16]``, ``scales`` and ``mins`` float16 ``[N/16, K/32, 16]``."""

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def planes(self) -> bool:
        return self.qs.dtype == torch.int32

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)`` of the weight."""
        if self.planes:
            return self.qs.shape[0] * PLANE_ROWS, self.qs.shape[1] * BLOCK
        return self.qs.shape[0], self.qs.shape[1] * BLOCK


PLANE_ROWS = 16  # weight rows a group of the bit-plane layout: one per AVX-512 lane


def can_plane(b: Blocks) -> bool:
    """Q4_1 in the GGUF's layout with N a multiple of :data:`PLANE_ROWS`."""
    return b.qs.dtype == torch.uint8 and b.qs.shape[0] % PLANE_ROWS == 0


def to_planes(b: Blocks) -> Blocks:
    """Q4_1 blocks (:func:`can_plane`) in bit planes for ``quant_planes.cpp``: per group of 16 rows and block,
    row r's word j holds 8 nibbles, nibble ``4h + k`` bit plane k of the block's weights ``4g .. 4g + 3``
    (g = 2j + h), its bit i bit k of q[4g + i]; d and m as the GGUF's float16 (exact: they came from it)."""
    n, nb, _ = b.qs.shape
    q = torch.cat([b.qs & 0xF, b.qs >> 4], dim=-1).to(torch.int32)  # [N, nb, 32] in weight order
    q = q.view(n // PLANE_ROWS, PLANE_ROWS, nb, 4, 2, 4)  # [group, row, block, word j, h, weight i]
    words = torch.zeros(n // PLANE_ROWS, PLANE_ROWS, nb, 4, dtype=torch.int32)
    for k in range(4):
        for h in range(2):
            for i in range(4):  # (bit 31 set by a shift: int32 wraps, the bits stay)
                words |= ((q[..., h, i] >> k) & 1) << (16 * h + 4 * k + i)
    qs = words.permute(0, 2, 3, 1).contiguous()

    def halves(t: torch.Tensor) -> torch.Tensor:
        h = t.view(n // PLANE_ROWS, PLANE_ROWS, nb).transpose(1, 2).contiguous().to(torch.float16)
        if not torch.equal(h.float().transpose(1, 2).reshape(n, nb), t):
            raise ValueError("Q4_1 scales or mins not exact in float16: not from a GGUF")
        return h

    return Blocks(qs, halves(b.scales), halves(b.mins))


def pack_gguf(data: np.ndarray, tensor_type) -> dict[str, np.ndarray] | None:
    """``data``: ``uint8 [N, K/32 * bytes_per_block]`` from ``gguf.GGUFReader`` → :class:`Blocks`' arrays, or
    None for a type the kernel does not read (F32, F16, K-quants, ...)."""
    from gguf import GGMLQuantizationType as Q

    def fp16(b: np.ndarray) -> np.ndarray:  # [N, nb, 2] bytes -> float32 [N, nb]
        return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)

    rows = data.shape[0]
    if tensor_type == Q.Q4_1:  # block: fp16 d, fp16 m, 16 bytes of nibbles
        b = data.reshape(rows, -1, 20)
        return {"scales": fp16(b[..., 0:2]), "mins": fp16(b[..., 2:4]), "qs": np.ascontiguousarray(b[..., 4:])}
    if tensor_type == Q.Q8_0:  # block: fp16 d, 32 int8
        b = data.reshape(rows, -1, 34)
        return {"scales": fp16(b[..., 0:2]), "qs": np.ascontiguousarray(b[..., 2:]).view(np.int8)}
    return None


def usable(model_dir: str | Path) -> bool:
    """Blocks stored and the kernel built (built on the first call in a process)."""
    return (Path(model_dir) / BLOCKS_FILE).is_file() and kernels.available()


def load_blocks(model_dir: str | Path) -> dict[str, Blocks] | None:
    """By Hugging Face weight name; None unless :func:`usable`."""
    path = Path(model_dir) / BLOCKS_FILE
    if not usable(model_dir):
        return None
    from safetensors.torch import load_file

    arrays = load_file(str(path))
    names = {key.rsplit(".", 1)[0] for key in arrays}
    return {name: Blocks(arrays[name + ".qs"], arrays[name + ".scales"], arrays.get(name + ".mins"))
            for name in names}
