"""GGUF weight blocks: read from a converted model and multiplied by ``quant_mm`` (``x @ W^T``
straight from the blocks).

Decode at a small batch is memory-bandwidth-bound: a float32 step reads every weight as
4 bytes, while a Q4_1 block stores 32 weights in 24 bytes here (float32 scale and min and
16 bytes of 4-bit quants; llama.cpp keeps fp16 scales, 20 bytes). The default model *is*
a Q4_1 GGUF (Q8_0 token embedding, tied to the LM head), and the float32 weights the loader
writes are exactly ``d * q + m`` of those blocks, so computing from the blocks is the
same maths up to summation order.

The kernel (``quant_kernels.cpp``, AVX2 + FMA, 16 lanes wide where the CPU has AVX-512)
is built on first use by ``kernels.py``; without AVX2/FMA, or when the build fails, there
are no blocks to use (:func:`load_blocks`).
Which layers hold blocks, a dense copy or both is the weight format's (``linear.py``).
"""

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
    """One weight ``W [N, K]`` as blocks of 32 along K.

    ``qs``: Q4_1 ``uint8 [N, K/32, 16]`` (byte j holds q[j] in its low nibble and q[j+16]
    in its high one, ggml's ``block_q4_1``; w = d * q + m, q in 0..15) or Q8_0
    ``int8 [N, K/32, 32]`` (w = d * q). ``scales`` (d) and ``mins`` (m, Q4_1 only) are
    float32 ``[N, K/32]``.
    """

    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None


def pack_gguf(data: np.ndarray, tensor_type) -> dict[str, np.ndarray] | None:
    """Split a GGUF tensor's raw blocks into the kernel's arrays.

    Args:
        data: ``uint8 [N, K/32 * bytes_per_block]`` as ``gguf.GGUFReader`` gives it.
        tensor_type: its ``gguf.GGMLQuantizationType``.
    Returns:
        ``{"qs", "scales"[, "mins"]}`` as described in :class:`Blocks`, or None for a
        type the kernel does not read (F32, F16, K-quants, ...).
    """
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
    """Whether ``model_dir`` has blocks a GGUF conversion stored and the kernel is built
    (building it on the first call in a process)."""
    return (Path(model_dir) / BLOCKS_FILE).is_file() and kernels.available()


def load_blocks(model_dir: str | Path) -> dict[str, Blocks] | None:
    """The weight blocks a GGUF conversion stored in ``model_dir`` (keyed by Hugging Face
    weight name), or None when they are not :func:`usable`."""
    path = Path(model_dir) / BLOCKS_FILE
    if not usable(model_dir):
        return None
    from safetensors.torch import load_file

    arrays = load_file(str(path))
    names = {key.rsplit(".", 1)[0] for key in arrays}
    return {name: Blocks(arrays[name + ".qs"], arrays[name + ".scales"], arrays.get(name + ".mins"))
            for name in names}
