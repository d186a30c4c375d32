"""Per-role precision: ``serve --prefill-dtype bfloat16`` runs bf16 prefill workers next to
float32 decode workers (the decode worker converts the imported KV), as does
``--prefill-kv-cache-dtype bfloat16`` (a float32 model, its KV cache bfloat16), the router accepts the
pair, and its greedy answer starts as float32's; any other KV layout difference between the
roles is still refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import _stop, start_deployment
from epdserve.serving.handshake import refusal
from epdserve.serving.protocol import PROTOCOL_VERSION

LAYOUT = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16, "dtype": "float32"}
SHAPE = {k: LAYOUT[k] for k in ("num_layers", "num_kv_heads", "head_dim")}


def hello(**layout) -> SimpleNamespace:
    return SimpleNamespace(worker_id="decode-9", role="decode", model="m", fingerprint="f", auth="",
                           kv_layout=dict(LAYOUT, **layout), protocol=PROTOCOL_VERSION)


def test_handshake_accepts_a_dtype_difference_only():
    peers = [("prefill-0", dict(LAYOUT, dtype="bfloat16"))]
    assert refusal(hello(), fingerprint="f", kv_shape=SHAPE, auth_token=None, peers=peers) is None
    reason = refusal(hello(block_size=32), fingerprint="f", kv_shape=SHAPE, auth_token=None, peers=peers)
    assert "'block_size': 32" in reason and "prefill-0" in reason


@pytest.mark.parametrize("flags", [["--prefill-dtype", "bfloat16"], ["--prefill-kv-cache-dtype", "bfloat16"]])
def test_bf16_prefill_float32_decode_serves(tmp_path, colocated_server, flags):
    """A bfloat16 prefill model, or a float32 one with a bfloat16 KV cache, hands its KV to a
    float32 decode worker."""
    dep = start_deployment("pd", tmp_path, *flags)
    try:
        workers = {w["worker_id"]: w for w in dep.health()["workers"]}
        assert {w["state"] for w in workers.values()} == {"up"}
        assert workers["prefill-0"]["kv_dtype"] == "bfloat16" and workers["decode-0"]["kv_dtype"] == "float32"
        prompt = "The capital of France is"
        first = dep.generate("completion", prompt, stream=False, max_tokens=2, temperature=0)
        assert first.text == colocated_server.generate("completion", prompt, stream=False, max_tokens=2,
                                                       temperature=0).text
        longer = dep.generate("completion", prompt, stream=True, max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})
        assert longer.usage.completion_tokens == 24 and longer.text.startswith(first.text)
        rec = dep.trace(longer.id)
        assert rec["path"] == "disaggregated" and rec["kv_bytes"] > 0
    finally:
        _stop(dep.proc)
