"""Who may join a deployment: the router's check of a worker's Hello (protocol version, model fingerprint,
KV layout, HMAC of its id on top of the sealed frame). The rules: docs/architecture.md, "Handshake"; a held
worker id: ``Registry.on_hello``."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

from epdserve.serving.protocol import PROTOCOL_VERSION

KV_PEER_ROLES = {"prefill": "decode", "decode": "prefill"}


def model_fingerprint(path: Path) -> str:
    """Hash of config.json and every safetensors header, not the weights: milliseconds. Raises OSError."""
    h = hashlib.sha256(Path(path, "config.json").read_bytes())
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(n))
    return h.hexdigest()[:16]


def model_kv_shape(path: Path) -> dict:
    """The part of a KV layout fixed by the model (a vision-language model's language model)."""
    c = json.loads(Path(path, "config.json").read_text())
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    return {"num_layers": c["num_hidden_layers"], "num_kv_heads": c.get("num_key_value_heads", heads),
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads}


def auth_tag(token: str | None, worker_id: str) -> str:
    """Hex HMAC-SHA256 of ``worker_id`` under ``token``; "" without a token."""
    if not token:
        return ""
    return hmac.new(token.encode(), worker_id.encode(), hashlib.sha256).hexdigest()


def refusal(hello, *, fingerprint: str, kv_shape: dict, auth_token: str | None,
            peers: list[tuple[str, dict]]) -> str | None:
    """Why ``hello`` must be refused, or None. ``peers``: ``(worker_id, kv_layout)`` of the live workers
    it may exchange KV with, whose layouts may differ from its own in ``dtype`` only."""
    if not hmac.compare_digest(hello.auth, auth_tag(auth_token, hello.worker_id)):
        return f"worker {hello.worker_id}: bad or missing auth token"
    if hello.protocol != PROTOCOL_VERSION:
        return (f"worker {hello.worker_id} speaks protocol version {hello.protocol}, the router "
                f"{PROTOCOL_VERSION}: run the same epdserve version on every host")
    if hello.fingerprint != fingerprint:
        return (f"worker {hello.worker_id} has model {hello.model!r} with fingerprint {hello.fingerprint}, "
                f"the router serves one with fingerprint {fingerprint}")
    mine = {k: hello.kv_layout.get(k) for k in kv_shape}
    if mine != kv_shape:
        return f"worker {hello.worker_id} has KV shape {mine}, the router's model needs {kv_shape}"
    for peer_id, layout in peers:
        if _without_dtype(layout) != _without_dtype(hello.kv_layout):
            return (f"worker {hello.worker_id} ({hello.role}) has KV layout {hello.kv_layout}, "
                    f"{peer_id} ({KV_PEER_ROLES.get(hello.role, 'its KV peer')}) has {layout}")
    return None


def _without_dtype(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k != "dtype"}
