"""KV on the wire as bf16 or int8 (``--kv-transfer-dtype``): round trips through a real
shared-memory frame, the int8 scale layout, and in-process PD hand-offs (real engines,
real frames) with compressed KV and with different cache dtypes per role."""

from __future__ import annotations

import pytest
import torch
import zmq

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.transfer import handoff, kv_codec, shm
from epdserve.transfer.loopback import generate_pd
from epdserve.transfer.wire import TensorHeader, WireError

SHAPE = [3, 2, 4, 16, 3, 64]  # layers, K/V, blocks, block_size, kv_heads, head_dim


def _round_trip(kv: torch.Tensor, transfer_dtype: str) -> tuple[TensorHeader, dict[str, torch.Tensor]]:
    header = TensorHeader(tensors=kv_codec.specs(list(kv.shape), kv.dtype, transfer_dtype), num_tokens=64,
                          layout={})
    name = shm.new_name()
    try:
        shm.write(name, header, lambda views: kv_codec.encode(kv, views))
        return shm.read(name)
    finally:
        shm.remove(name)


@pytest.mark.parametrize("transfer_dtype,wire_dtype,tolerance", [
    ("none", torch.float32, 0.0), ("bf16", torch.bfloat16, 2**-8), ("int8", torch.int8, 0.5 / 127)])
def test_round_trip_through_a_frame(transfer_dtype, wire_dtype, tolerance):
    kv = torch.randn(SHAPE) * torch.linspace(0.01, 10, SHAPE[-2]).unsqueeze(-1)  # heads of different scales
    header, tensors = _round_trip(kv, transfer_dtype)
    assert tensors["kv"].dtype == wire_dtype and list(tensors["kv"].shape) == SHAPE
    back = kv_codec.decode(tensors, torch.float32)
    assert back.dtype == torch.float32 and back.shape == kv.shape
    # bf16: relative error of its 8-bit mantissa; int8: half a step of each head's scale.
    bound = tolerance * (kv.abs() if transfer_dtype == "bf16" else kv.abs().amax(-1, keepdim=True))
    assert ((back - kv).abs() <= bound + 1e-12).all()


def test_int8_scales_are_per_token_per_head():
    kv = torch.randn(SHAPE)
    kv[1, 0, 2, 5, 1] = 0.0  # one all-zero head of one token
    header, tensors = _round_trip(kv, "int8")
    assert [s.name for s in header.tensors] == ["kv", "scales"]
    scales = tensors["scales"]
    assert scales.dtype == torch.float32 and list(scales.shape) == SHAPE[:-1]
    assert torch.allclose(scales, kv.abs().amax(-1) / 127)
    assert scales[1, 0, 2, 5, 1] == 0 and (kv_codec.decode(tensors, torch.float32)[1, 0, 2, 5, 1] == 0).all()
    assert tensors["kv"].abs().amax() == 127


def test_int8_frame_without_scales_is_rejected():
    _, tensors = _round_trip(torch.randn(SHAPE), "int8")
    with pytest.raises(WireError, match="scales"):
        kv_codec.decode({"kv": tensors["kv"]}, torch.float32)
    with pytest.raises(WireError, match="scales"):
        kv_codec.decode({"kv": tensors["kv"], "scales": tensors["scales"][..., :1]}, torch.float32)


# --- in-process PD hand-offs --------------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(model_info):
    path = str(model_info.path)
    made = {(role, dtype): LLMEngine(path, EngineConfig(dtype=dtype, kv_cache_memory_mb=32))
            for role, dtype in [("prefill", "float32"), ("decode", "float32"), ("decode", "bfloat16")]}
    ctx = zmq.Context()
    yield made, ctx
    ctx.destroy(linger=0)


def _run(engines, tokenizer, transfer_dtype: str, decode_dtype: str) -> list[list[int]]:
    """Each prompt of PROMPTS through a PD hand-off; checks the hand-off's bookkeeping."""
    made, ctx = engines
    prefill, decode = made[("prefill", "float32")], made[("decode", decode_dtype)]
    exporter = handoff.Exporter(prefill, 60, ctx, None, transfer_dtype)
    importer = handoff.Importer(ctx, "auto", 5)
    results = []
    for i, prompt in enumerate(PROMPTS):
        tokens, timings = generate_pd(prefill, decode, exporter, importer, f"{transfer_dtype}-{decode_dtype}-{i}",
                                      tokenizer(prompt).input_ids, SAMPLING)
        assert len(tokens) == SAMPLING.max_tokens
        assert timings.kv_tcp == 0.0 and timings.kv_bytes > 0 and timings.kv_import_ms is not None
        results.append(tokens)
    assert not exporter.table and prefill.pool.num_in_use == 0 and decode.pool.num_in_use == 0
    exporter.close()
    return results


@pytest.fixture(scope="module")
def uncompressed(engines, tokenizer):
    """Tokens of the plain float32 hand-off (equal to colocated: test_serving_equivalence)."""
    return _run(engines, tokenizer, "none", "float32")


@pytest.mark.parametrize("transfer_dtype,decode_dtype", [("bf16", "float32"), ("int8", "float32"),
                                                         ("none", "bfloat16")])
def test_pd_hand_off(engines, tokenizer, uncompressed, transfer_dtype, decode_dtype):
    tokens = _run(engines, tokenizer, transfer_dtype, decode_dtype)
    assert [t[0] for t in tokens] == [t[0] for t in uncompressed], "the first token comes from the same prefill"


def test_read_kv_copies_runs_of_blocks_in_order(engines, uncompressed):
    made, _ = engines
    prefill = made[("prefill", "float32")]  # its first blocks hold the KV of the hand-offs before
    ids = [2, 3, 0, 1, 7, 8, 4]
    expected = prefill.kv_cache.index_select(2, torch.tensor(ids))
    assert expected.abs().sum() > 0
    assert torch.equal(prefill.read_kv(ids), expected)
    out = torch.empty(expected.shape, dtype=torch.bfloat16)
    assert torch.equal(prefill.read_kv(ids, out=out), expected.to(torch.bfloat16))
