"""The weight-only quantized matmul kernel (model/quant.py) on the default GGUF's real
Q4_1 and Q8_0 weights: against float64 matmuls of gguf's own dequantization, and the
blocks stored by the GGUF conversion against the float32 weights. Engines in each weight
format against each other: tests/test_weight_formats.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from epdserve.model import kernels, linear, quant
from epdserve.model.loader import default_gguf

pytestmark = pytest.mark.skipif(not kernels.cpu_supported(), reason="the kernel needs AVX2 and FMA")


@pytest.fixture(scope="module")
def kernel():
    assert kernels.available(), "the kernel failed to build (see the log)"
    return torch.ops.epdserve.quant_mm


@pytest.fixture(scope="module")
def gguf_tensors():
    import gguf

    return {t.name: t for t in gguf.GGUFReader(default_gguf()).tensors}


@pytest.mark.parametrize("name, kind", [("blk.3.ffn_down.weight", "Q4_1"), ("blk.0.attn_q.weight", "Q4_1"),
                                        ("token_embd.weight", "Q8_0")])
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 100])
def test_kernel_matches_dequantized_matmul(kernel, gguf_tensors, name, kind, rows):
    import gguf

    t = gguf_tensors[name]
    assert t.tensor_type.name == kind
    data = t.data[:2048]  # the Q8_0 embedding has 49,152 rows; 2,048 suffice
    w = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type).reshape(data.shape[0], -1))
    packed = {k: torch.from_numpy(v) for k, v in quant.pack_gguf(data, t.tensor_type).items()}
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    y = kernel(x, packed["qs"], packed["scales"], packed.get("mins"))
    expected = (x.double() @ w.double().T).float()
    assert y.shape == (rows, w.shape[0])
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    layer = linear.Linear(quant.Blocks(packed["qs"], packed["scales"], packed.get("mins")), None)
    assert torch.equal(layer.dequantize(), w)  # the same two roundings as gguf's numpy code
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


AVX512 = pytest.mark.skipif(not kernels.AVX512 <= kernels.cpu_flags(), reason="bit planes need AVX-512")


@AVX512
@pytest.mark.parametrize("name", ["blk.3.ffn_down.weight", "blk.0.attn_q.weight", "blk.5.ffn_gate.weight"])
def test_bit_planes_hold_the_same_weights_and_products(kernel, gguf_tensors, name):
    """``quant.to_planes``: the same weights bit for bit, and the kernel's products at every path (the subset
    tables below 4 rows, the outer products above) within float32 rounding of float64's."""
    import gguf

    t = gguf_tensors[name]
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(t.data.shape[0], -1))
    b = quant.Blocks(**{k: torch.from_numpy(v) for k, v in quant.pack_gguf(t.data, t.tensor_type).items()})
    planes = quant.to_planes(b)
    assert planes.planes and planes.shape == b.shape == tuple(w.shape)
    assert planes.qs.numel() * 4 + planes.scales.numel() * 4 == w.numel() * 20 // 32  # 20 bytes a block
    assert torch.equal(torch.ops.epdserve.dequantize(planes.qs, planes.scales, planes.mins), w)
    for rows in (1, 2, 3, 4, 9, 100):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        y = kernel(x, planes.qs, planes.scales, planes.mins)
        torch.testing.assert_close(y, (x.double() @ w.double().T).float(), rtol=1e-4, atol=1e-4)


@AVX512
def test_bit_planes_refuse_what_they_cannot_hold(kernel):
    b = quant.Blocks(torch.zeros(24, 1, 16, dtype=torch.uint8), torch.ones(24, 1), torch.zeros(24, 1))
    assert not quant.can_plane(b)  # 24 rows: not whole groups of 16
    with pytest.raises(ValueError, match="float16"):
        quant.to_planes(quant.Blocks(torch.zeros(16, 1, 16, dtype=torch.uint8), torch.full((16, 1), 0.1),
                                     torch.zeros(16, 1)))
    planes = quant.to_planes(quant.Blocks(torch.zeros(16, 1, 16, dtype=torch.uint8), torch.ones(16, 1),
                                          torch.zeros(16, 1)))
    with pytest.raises(RuntimeError, match="float16"):
        kernel(torch.ones(1, 32), planes.qs, planes.scales.float(), planes.mins)
    with pytest.raises(RuntimeError, match="columns"):
        kernel(torch.ones(1, 64), planes.qs, planes.scales, planes.mins)


def test_large_batches_run_on_the_dequantized_weight(kernel, gguf_tensors):
    import gguf

    t = gguf_tensors["blk.7.ffn_gate.weight"]
    w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
    packed = {k: torch.from_numpy(v) for k, v in quant.pack_gguf(t.data, t.tensor_type).items()}
    layer = linear.Linear(quant.Blocks(packed["qs"], packed["scales"], packed["mins"]), None, kernel_rows=64)
    x = torch.randn(64 + 1, w.shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer(x), F.linear(x, w))  # sgemm on the dequantized weight, bit for bit
    assert layer(x[:-1]).shape == (64, w.shape[0])
    torch.testing.assert_close(layer(x[:-1]), x[:-1] @ w.T, rtol=1e-4, atol=1e-4)


def test_stored_blocks_are_the_float32_weights(kernel, model_info):
    """The conversion's blocks (Q/K rows un-permuted like the float weights) dequantize
    to the float32 weights bit for bit."""
    from safetensors.torch import load_file

    weights = load_file(str(model_info.path / "model.safetensors"))
    blocks = quant.load_blocks(model_info.path)
    assert blocks is not None and len(blocks) == 211
    assert {b.qs.dtype for b in blocks.values()} == {torch.uint8, torch.int8}
    for name, b in blocks.items():
        assert torch.equal(linear.Linear(b, None).dequantize(), weights[name]), name


def test_pack_gguf_leaves_other_types_alone():
    from gguf import GGMLQuantizationType as Q

    assert quant.pack_gguf(np.zeros((4, 16), np.uint8), Q.F32) is None
    assert quant.pack_gguf(np.zeros((4, 144), np.uint8), Q.Q4_K) is None
