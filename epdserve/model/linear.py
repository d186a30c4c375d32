"""Linear layers in a weight format (``--weight-format``): GGUF blocks (``q4_1``; decode is memory-bound:
0.75 byte a weight against 4), a dense ``f32``/``bf16`` copy (prefill GEMMs by the BLAS; ``bf16`` packed for
oneDNN), or both (steps up to :attr:`Linear.kernel_rows`, measured per machine, on the blocks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from epdserve.model import cutover, quant, tuning

WEIGHT_FORMATS = ("auto", "f32", "bf16", "q4_1", "q4_1+f32", "q4_1+bf16")
DENSE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
DTYPE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class WeightFormat:
    """``dense``: the dense copy's dtype, or None."""

    blocks: bool
    dense: torch.dtype | None

    @property
    def name(self) -> str:
        parts = (["q4_1"] if self.blocks else []) + ([DTYPE_FORMATS[self.dense]] if self.dense else [])
        return "+".join(parts)


def parse(name: str) -> WeightFormat:
    """Raises ValueError for ``auto`` or an unknown name."""
    if name not in WEIGHT_FORMATS or name == "auto":
        raise ValueError(f"weight format {name!r}: expected one of {', '.join(WEIGHT_FORMATS[1:])}")
    blocks, _, dense = name.partition("+") if name.startswith("q4_1") else ("", "", name)
    return WeightFormat(blocks=bool(blocks), dense=DENSE_DTYPES[dense] if dense else None)


def auto_format(prefill: bool, decode: bool) -> str:
    if prefill and decode:
        return "q4_1+f32"
    return "f32" if prefill else "q4_1"


def resolve(name: str, dtype: torch.dtype, has_blocks: bool, prefill: bool = True, decode: bool = True) -> WeightFormat:
    """``auto`` by :func:`auto_format`, dense only without blocks or off float32. Raises ValueError: an unknown
    name, or blocks or a float32 copy on a model that cannot hold them (they need ``--dtype float32``)."""
    if name == "auto":
        fmt = parse(auto_format(prefill, decode))
        if not has_blocks or dtype != torch.float32:
            return WeightFormat(blocks=False, dense=dtype)
        return fmt
    fmt = parse(name)
    if dtype != torch.float32 and (fmt.blocks or fmt.dense == torch.float32):
        runs_in = str(dtype).removeprefix("torch.")
        raise ValueError(f"--weight-format {name} needs --dtype float32 (this model runs in {runs_in})")
    if fmt.blocks and not has_blocks:
        raise ValueError(f"--weight-format {name}: this model has no Q4_1 / Q8_0 GGUF blocks, or the C++ "
                         "kernels are not built (a GGUF model, and a CPU with AVX2 and FMA); use f32 or bf16")
    return fmt


class Linear:
    """``W [N, K]`` as GGUF blocks, a dense float32/bfloat16 copy, or both; steps up to ``kernel_rows`` rows on
    the blocks, larger ones by the BLAS (blocks dequantized per call if no copy). Raises ValueError with neither."""

    def __init__(self, blocks: quant.Blocks | None, dense: torch.Tensor | None, kernel_rows: int = 0):
        if blocks is None and dense is None:
            raise ValueError("a linear layer needs blocks or a dense weight")
        self.blocks, self.dense, self.kernel_rows = blocks, dense, kernel_rows
        # Resolved once: looking the overload up costs a few µs, 121 times a decode step.
        self._matmul = torch.ops.epdserve.quant_mm.default if blocks is not None else None

    def on_blocks(self, rows: int) -> bool:
        return self.blocks is not None and rows <= self.kernel_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` in ``x``'s dtype (plus ``bias [N]``)."""
        y = self.on_kernel(x) if self.on_blocks(len(x)) else self.on_blas(x)
        return y if bias is None else y + bias

    def on_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` float32 @ W^T by the block kernel."""
        return self._matmul(x, self.blocks.qs, self.blocks.scales, self.blocks.mins)

    def on_blas(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` cast to the dense copy's dtype and back (a packed copy by oneDNN)."""
        w = self.dense if self.dense is not None else self.dequantize()
        if w.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), w, None, "none", [], "").to(x.dtype)
        return F.linear(x.to(w.dtype), w).to(x.dtype)

    def kernel_tensors(self, rows: int) -> list[torch.Tensor]:
        """For the C++ decode-layer kernel: ``[qs, scales]`` (Q8_0), ``[qs, scales, mins]`` (Q4_1) or ``[W]``."""
        if self.on_blocks(rows):
            b = self.blocks
            return [b.qs, b.scales] + ([] if b.mins is None else [b.mins])
        return [self.dense]

    def dequantize(self) -> torch.Tensor:
        """``W [N, K]`` float32 from the blocks, equal to ``gguf.quants.dequantize`` of them."""
        b = self.blocks
        return torch.ops.epdserve.dequantize(b.qs, b.scales, b.mins)

    def nbytes(self) -> int:
        parts = [self.dense] if self.dense is not None else []
        if self.blocks is not None:
            parts += [t for t in (self.blocks.qs, self.blocks.scales, self.blocks.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)


def projection(weights: dict[str, torch.Tensor], blocks: dict[str, quant.Blocks] | None, names: list[str],
               fmt: WeightFormat) -> Linear:
    """``names`` fused into one ``[sum N_i, K]`` layer: blocks if all share one block type, and a dense copy if
    ``fmt`` has one or the blocks are missing."""
    parts = [blocks.get(n) for n in names] if fmt.blocks and blocks else [None]
    joined = None
    if all(p is not None for p in parts) and len({(p.qs.dtype, p.mins is None) for p in parts}) == 1:
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        joined = quant.Blocks(torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]), mins)
    dense = None
    if joined is None or fmt.dense is not None:
        dense = weights[names[0]] if len(names) == 1 else torch.cat([weights[n] for n in names])
        dense = dense.to(fmt.dense or dense.dtype)
        dense = pack(dense) if dense.dtype == torch.bfloat16 else dense  # (float32: by measurement, later)
    return Linear(joined, dense)


def pack(dense: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` in oneDNN's packed (``is_mkldnn``) layout where available: ``F.linear`` re-packs a bfloat16
    weight every call (SmolLM2-135M, 30 layers at 286 rows: 45-47 ms packed vs 56-58, AMX; bit-identical)."""
    if dense.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(dense)
    return dense


Q4_1_LAYOUTS = ("gguf", "planes")  # quant.Blocks as the GGUF has them, or in bit planes (quant.to_planes)
LAYOUT_STEPS = 4  # decode steps' GEMVs a timed round runs: one is ~5 ms on 2 threads, within the noise


def measured_q4_layout(layers: list[list[Linear]], planes: Callable[[], list[list[quant.Blocks]]],
                       force: bool = False) -> tuning.Tuned:
    """The layout whose kernel ran a decode step's GEMVs (one row through every layer's blocks) faster here:
    the GGUF's (``quant_kernels.cpp``) or bit planes (``quant_planes.cpp``, AVX-512 only: callers check);
    ``planes()``: ``layers``' blocks in bit planes (called only to measure). On a 2-core Zen 4, SmolLM2-135M's
    30 layers at one row: 5.2-7.1 ms gguf, 4.4-6.1 planes (20 bytes a block against 24; 1.45x the weights per
    second in cache); at 2-48 rows 0.9-1.3x."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, p.blocks.shape[1], generator=gen) for p in layers[0]]

    def measure() -> tuning.Attempt:
        ways = {"gguf": [[p.blocks for p in layer] for layer in layers], "planes": planes()}
        return tuning.time_rounds({way: lambda blocks=blocks: [
            torch.ops.epdserve.quant_mm(x, b.qs, b.scales, b.mins)
            for _ in range(LAYOUT_STEPS) for layer in blocks for b, x in zip(layer, xs)] for way, blocks in ways.items()})

    key = [len(layers), *(list(p.blocks.qs.shape) for p in layers[0])]
    return tuning.choose("q4_1_layout", key, measure, lambda seconds: min(Q4_1_LAYOUTS, key=seconds.__getitem__),
                         Q4_1_LAYOUTS.__contains__, force)


F32_GEMMS = ("mkl", "onednn")  # float32 dense weights: plain for MKL's sgemm, or packed for oneDNN
F32_GEMM_ROWS = 256  # the step the float32 GEMM library is timed on: a prompt's prefill


def measured_f32_gemm(layers: list[list[Linear]], force: bool = False) -> tuning.Tuned:
    """MKL's sgemm or oneDNN packed, whichever ran :data:`F32_GEMM_ROWS` rows of every layer faster here (2-core AMX
    Xeon, SmolLM2-135M: 235-255 ms packed vs 249-277 MKL; results differ by ~5e-6)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(F32_GEMM_ROWS, p.dense.shape[1], generator=gen) for p in layers[0]]
    plain = [[p.dense for p in layer] for layer in layers]

    def measure() -> tuning.Attempt:
        packed = [[pack(w) for w in layer] for layer in plain]
        run = {"mkl": lambda: [F.linear(x, w) for layer in plain for w, x in zip(layer, xs)],
               "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                  for layer in packed for w, x in zip(layer, xs)]}
        return tuning.time_rounds(run)

    key = [len(layers), *(list(w.shape) for w in plain[0])]
    return tuning.choose("f32_gemm", key, measure, lambda seconds: min(F32_GEMMS, key=seconds.__getitem__),
                         F32_GEMMS.__contains__, force)


def measured_kernel_rows(layers: list[list[Linear]], force: bool = False) -> tuning.Tuned:
    """Timed over every layer: one layer alone stays in cache and flatters the dense copy (SmolLM2-135M, 32 rows:
    a layer 1.17 ms on blocks vs 0.93 dense; a whole step 82 vs 92)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(max(cutover.ROWS), p.blocks.shape[1], generator=gen) for p in layers[0]]

    def kernel(rows: int) -> list[torch.Tensor]:
        return [p.on_kernel(x[:rows]) for layer in layers for p, x in zip(layer, xs)]

    def blas(rows: int) -> list[torch.Tensor]:
        return [p.on_blas(x[:rows]) for layer in layers for p, x in zip(layer, xs)]

    key = [len(layers), *([list(p.blocks.qs.shape), str(p.blocks.qs.dtype), None if p.dense is None else
                            str(p.dense.dtype) + (" packed" if p.dense.is_mkldnn else "")] for p in layers[0])]
    return cutover.kernel_rows(kernel, blas, key, force)
