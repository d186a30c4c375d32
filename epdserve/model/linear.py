"""Linear layers in a weight format: which copies of each weight ``W [N, K]`` a worker holds
and which matmul a step runs on them.

Prefill is compute-bound: its GEMMs run fastest on dense weights through the BLAS (MKL's
sgemm or oneDNN in float32, whichever measured faster here: :func:`measured_f32_gemm`;
oneDNN's AVX512-BF16 / AMX kernels in bfloat16). Decode at a small batch
is memory-bound: it runs fastest on the GGUF's blocks, 0.75 byte per Q4_1 weight against 4
(``quant.py``). So each role holds what its steps need (``--weight-format``):

* ``f32``, ``bf16``: one dense copy, every matmul on it. ``bf16`` (packed for oneDNN,
  :func:`pack`) on a float32 model: the model hands each matmul a bfloat16 input (its norms,
  SiLU x up and attention write it so) and keeps its bfloat16 output, added to the float32
  residual stream; a float32 input is cast (the result cast back).
* ``q4_1``: the GGUF's blocks only (the default model's Q4_1 layers and its Q8_0 LM head);
  larger steps dequantize each weight for the call.
* ``q4_1+f32``, ``q4_1+bf16``: both; small steps on the blocks, larger ones on the dense
  copy.
* ``auto``, by what the worker runs (:func:`auto_format`): prefill only, ``f32``; decode only,
  ``q4_1``; both (colocated, elastic), ``q4_1+f32``. Without blocks (a Hugging Face model, the
  kernels not built, a GPU, a bfloat16 model) the dense copy in the model's dtype.

Where "small" ends (:attr:`Linear.kernel_rows`) is measured on the machine and the engine's
threads (``cutover.py``) by the model that holds the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from epdserve.model import cutover, quant, tuning

WEIGHT_FORMATS = ("auto", "f32", "bf16", "q4_1", "q4_1+f32", "q4_1+bf16")
DENSE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
DTYPE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class WeightFormat:
    """A parsed ``--weight-format``: ``blocks`` (hold the GGUF blocks) and ``dense`` (the
    dtype of the dense copy, or None)."""

    blocks: bool
    dense: torch.dtype | None

    @property
    def name(self) -> str:
        """Its ``--weight-format`` name (``q4_1+f32``, ...)."""
        parts = (["q4_1"] if self.blocks else []) + ([DTYPE_FORMATS[self.dense]] if self.dense else [])
        return "+".join(parts)


def parse(name: str) -> WeightFormat:
    """A concrete ``--weight-format`` (not ``auto``).

    Raises:
        ValueError: ``auto`` or a name not in :data:`WEIGHT_FORMATS`.
    """
    if name not in WEIGHT_FORMATS or name == "auto":
        raise ValueError(f"weight format {name!r}: expected one of {', '.join(WEIGHT_FORMATS[1:])}")
    blocks, _, dense = name.partition("+") if name.startswith("q4_1") else ("", "", name)
    return WeightFormat(blocks=bool(blocks), dense=DENSE_DTYPES[dense] if dense else None)


def auto_format(prefill: bool, decode: bool) -> str:
    """``auto`` for a worker that runs prefills and / or decodes (see the module doc)."""
    if prefill and decode:
        return "q4_1+f32"
    return "f32" if prefill else "q4_1"


def resolve(name: str, dtype: torch.dtype, has_blocks: bool, prefill: bool = True, decode: bool = True) -> WeightFormat:
    """The format a model in ``dtype`` holds for ``--weight-format name``: ``auto`` by
    :func:`auto_format`, its block part dropped when ``has_blocks`` is False; the dense
    part of a bfloat16 model is bfloat16.

    Raises:
        ValueError: an unknown name; a format with blocks on a model without them, or with
            a float32 dense copy on a bfloat16 model (the blocks' kernels and float32
            activations need ``--dtype float32``).
    """
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
    """``x @ W^T`` for one weight ``W [N, K]`` held as GGUF blocks, a dense copy, or both.

    ``blocks``: a :class:`quant.Blocks` or None; ``dense``: ``[N, K]`` float32 or bfloat16,
    or None (one of the two is given). ``kernel_rows``: steps of up to this many rows run on
    the blocks, larger ones on the BLAS (the dense copy, else the blocks dequantized for the
    call); the model sets it once it has measured its layers (``cutover.py``).

    Raises (constructor): ``ValueError`` with neither blocks nor a dense weight.
    """

    def __init__(self, blocks: quant.Blocks | None, dense: torch.Tensor | None, kernel_rows: int = 0):
        if blocks is None and dense is None:
            raise ValueError("a linear layer needs blocks or a dense weight")
        self.blocks, self.dense, self.kernel_rows = blocks, dense, kernel_rows
        # The overload itself: resolving torch.ops.epdserve.quant_mm per call costs a few
        # microseconds, 121 times per decode step.
        self._matmul = torch.ops.epdserve.quant_mm.default if blocks is not None else None

    def on_blocks(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs on the blocks."""
        return self.blocks is not None and rows <= self.kernel_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` in ``x``'s dtype (plus ``bias [N]``)."""
        y = self.on_kernel(x) if self.on_blocks(len(x)) else self.on_blas(x)
        return y if bias is None else y + bias

    def on_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` float32 @ W^T by the block kernel."""
        return self._matmul(x, self.blocks.qs, self.blocks.scales, self.blocks.mins)

    def on_blas(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` @ W^T by the BLAS on the dense copy (``x`` cast to its dtype and the
        result back; a :func:`pack`-ed copy by oneDNN), else on the blocks dequantized for
        this call."""
        w = self.dense if self.dense is not None else self.dequantize()
        if w.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), w, None, "none", [], "").to(x.dtype)
        return F.linear(x.to(w.dtype), w).to(x.dtype)

    def kernel_tensors(self, rows: int) -> list[torch.Tensor]:
        """The weight as the C++ decode-layer kernel takes it for a step of ``rows`` rows:
        its blocks ``[qs, scales]`` (Q8_0) or ``[qs, scales, mins]`` (Q4_1), else its dense
        copy ``[W]`` (a blocks-only layer has none past the cut-over: those steps run the
        per-layer code, which dequantizes per call)."""
        if self.on_blocks(rows):
            b = self.blocks
            return [b.qs, b.scales] + ([] if b.mins is None else [b.mins])
        return [self.dense]

    def dequantize(self) -> torch.Tensor:
        """``W [N, K]`` float32 from the blocks, equal to ``gguf.quants.dequantize`` of them."""
        b = self.blocks
        return torch.ops.epdserve.dequantize(b.qs, b.scales, b.mins)

    def nbytes(self) -> int:
        """Bytes this layer holds (blocks and dense copy)."""
        parts = [self.dense] if self.dense is not None else []
        if self.blocks is not None:
            parts += [t for t in (self.blocks.qs, self.blocks.scales, self.blocks.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)


def projection(weights: dict[str, torch.Tensor], blocks: dict[str, quant.Blocks] | None, names: list[str],
               fmt: WeightFormat) -> Linear:
    """The weights ``names`` (``[N_i, K]`` each) as one ``[sum N_i, K]`` projection (one
    matmul for Q, K and V, or for gate and up) in format ``fmt``. Its blocks when ``fmt``
    has them and ``blocks`` hold all of ``names`` in one block type; its dense copy (from
    ``weights``, in ``fmt.dense``) when ``fmt`` has one or the blocks are missing (a group
    the GGUF stored in another type stays dense, in the weights' dtype)."""
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
    """A weight ``[N, K]`` on the CPU in oneDNN's packed layout (an opaque ``is_mkldnn``
    tensor of the same shape and dtype), when PyTorch has oneDNN; else ``dense`` as it is.
    ``F.linear`` on the plain layout re-packs a bfloat16 weight on every call: SmolLM2-135M's
    30 layers at 286 rows take 45-47 ms packed against 56-58 (Xeon with AMX), with
    bit-identical results. A float32 weight is packed where oneDNN measured faster than MKL
    (:func:`measured_f32_gemm`)."""
    if dense.device.type == "cpu" and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(dense)
    return dense


F32_GEMMS = ("mkl", "onednn")  # float32 dense weights: plain for MKL's sgemm, or packed for oneDNN
F32_GEMM_ROWS = 256  # the step the float32 GEMM library is timed on: a prompt's prefill


def measured_f32_gemm(layers: list[list[Linear]], force: bool = False) -> tuning.Tuned:
    """Whether the float32 dense copies of ``layers`` (``layers[i]``: layer i's projections,
    each with a plain float32 ``dense``) run a prefill faster on MKL's sgemm as they are or
    on oneDNN packed once (:func:`pack`): every layer's projections timed both ways at
    :data:`F32_GEMM_ROWS` rows (packed copies made for the timing), through
    ``tuning.choose`` (kept per machine; ``force``: measured again). On a 2-core Xeon with
    AMX, SmolLM2-135M's 30 layers at 286 rows: 235-255 ms packed against 249-277 on MKL, the
    same at 1,024 rows; the two round differently (~5e-6 on a 576-wide product)."""
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
    """The kernel / BLAS cut-over (:attr:`Linear.kernel_rows`) for the decoder layers'
    projections (``layers[i]``: layer i's, each with blocks), measured on this machine or
    read from its cache (``cutover.kernel_rows``; ``force``: measured again). Each timing runs every layer once, as a
    step reads them: one layer timed alone stays in the CPU's cache and flatters the dense
    copy (SmolLM2-135M at 32 rows: one layer 1.17 ms on the blocks, 0.93 dense; a whole
    decode step 82 ms on the blocks, 92 dense)."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(max(cutover.ROWS), p.blocks.qs.shape[1] * quant.BLOCK, generator=gen) for p in layers[0]]

    def kernel(rows: int) -> list[torch.Tensor]:
        return [p.on_kernel(x[:rows]) for layer in layers for p, x in zip(layer, xs)]

    def blas(rows: int) -> list[torch.Tensor]:
        return [p.on_blas(x[:rows]) for layer in layers for p, x in zip(layer, xs)]

    key = [len(layers), *([list(p.blocks.qs.shape), str(p.blocks.qs.dtype), None if p.dense is None else
                            str(p.dense.dtype) + (" packed" if p.dense.is_mkldnn else "")] for p in layers[0])]
    return cutover.kernel_rows(kernel, blas, key, force)
