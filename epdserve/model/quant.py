"""Weight-only quantized linear layers: ``y = x @ W^T`` straight from a GGUF's weight blocks.

Decode at a small batch is memory-bandwidth-bound: a float32 step reads every weight as
4 bytes, while a Q4_1 block stores 32 weights in 24 bytes here (float32 scale and min and
16 bytes of 4-bit quants; llama.cpp keeps fp16 scales, 20 bytes). The default model *is*
a Q4_1 GGUF (Q8_0 token embedding, tied to the LM head), and the float32 weights the loader
writes are exactly ``d * q + m`` of those blocks, so computing from the blocks is the
same maths up to summation order.

The kernel (``quant_kernels.cpp``, AVX2 + FMA) is built on first use by ``kernels.py``;
without AVX2/FMA, or when the build fails, the model keeps float32 weights. A model on
blocks holds 0.75 byte per Q4_1 weight (SmolLM2-135M: ~150 MiB resident instead of ~550).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from epdserve.model import kernels

BLOCK = 32  # weights per block along K, ggml's QK4_1 and QK8_0
BLOCKS_FILE = Path("quantized") / "blocks.safetensors"  # inside a GGUF-converted model dir
# Above this many rows x @ W^T dequantizes W and runs MKL's sgemm: the kernel's dot
# products are slower than sgemm's, which wins once the weights' bytes no longer dominate
# (long prefill chunks). On the dev CPU (AVX2, 1 thread, all of SmolLM2-135M's linear
# layers, noisy shared machine) the kernel took 0.65x the time of dequantize + sgemm at 64
# rows, 0.82x at 128, 0.96x at 256; at 512 it took 1.11x plain float32 sgemm's.
MAX_KERNEL_ROWS = 256


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


def load_blocks(model_dir: str | Path) -> dict[str, Blocks] | None:
    """The weight blocks a GGUF conversion stored in ``model_dir`` (keyed by Hugging Face
    weight name), or None when there are none or the kernel is not available."""
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file() or not kernels.available():
        return None
    from safetensors.torch import load_file

    arrays = load_file(str(path))
    names = {key.rsplit(".", 1)[0] for key in arrays}
    return {name: Blocks(arrays[name + ".qs"], arrays[name + ".scales"], arrays.get(name + ".mins"))
            for name in names}


class QuantLinear:
    """``x @ W^T`` for a weight ``W [N, K]`` held only as :class:`Blocks` (0.75 byte per
    Q4_1 weight, 1.125 per Q8_0 one, against 4 for float32).

    Up to :data:`MAX_KERNEL_ROWS` rows of ``x`` run on the kernel; larger batches (prefill
    chunks) dequantize ``W`` for the call and use ``F.linear`` (MKL's sgemm).
    """

    def __init__(self, blocks: Blocks):
        self.blocks = blocks
        # The overload itself: resolving torch.ops.epdserve.quant_mm per call costs a few
        # microseconds, 121 times per decode step.
        self._matmul = torch.ops.epdserve.quant_mm.default

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` float32 -> ``[M, N]`` float32."""
        if len(x) > MAX_KERNEL_ROWS:
            return F.linear(x, self.dequantize())
        return self._matmul(x, self.blocks.qs, self.blocks.scales, self.blocks.mins)

    def dequantize(self) -> torch.Tensor:
        """``W [N, K]`` in float32, equal to ``gguf.quants.dequantize`` of the blocks."""
        b = self.blocks
        return torch.ops.epdserve.dequantize(b.qs, b.scales, b.mins)


def projection(weights: dict[str, torch.Tensor], blocks: dict[str, Blocks] | None,
               names: list[str]) -> torch.Tensor | QuantLinear:
    """The weights ``names`` (``[N_i, K]`` each) as one ``[sum N_i, K]`` projection (one
    matmul for Q, K and V, or for gate and up): a :class:`QuantLinear` when ``blocks``
    hold all of ``names`` in one block type, else the float tensor from ``weights``."""
    parts = [blocks.get(n) for n in names] if blocks else [None]
    if any(p is None for p in parts) or len({(p.qs.dtype, p.mins is None) for p in parts}) > 1:
        return weights[names[0]] if len(names) == 1 else torch.cat([weights[n] for n in names])
    if len(parts) == 1:
        return QuantLinear(parts[0])
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    return QuantLinear(Blocks(torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]), mins))


def kernel_tensors(weight: torch.Tensor | QuantLinear) -> list[torch.Tensor]:
    """A projection as the C++ layer kernel takes it: ``[W]`` for a float weight, else its
    blocks ``[qs, scales]`` (Q8_0) or ``[qs, scales, mins]`` (Q4_1)."""
    if isinstance(weight, QuantLinear):
        b = weight.blocks
        return [b.qs, b.scales] + ([] if b.mins is None else [b.mins])
    return [weight]


def linear(x: torch.Tensor, weight: torch.Tensor | QuantLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a float weight ``[N, K]`` or a :class:`QuantLinear`."""
    if isinstance(weight, QuantLinear):
        y = weight(x)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)
