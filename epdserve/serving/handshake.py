"""Who may join a deployment: what a worker declares in its Hello (model fingerprint,
KV layout, an HMAC of its id) and the router's check of it.

A worker is refused when its weights differ from the router's model, when its KV layout
cannot hold the router's model, when (PD) its KV layout differs from the live workers of
the other role in anything but the dtype (they could not exchange KV blocks; a decode
worker converts imported KV to its own dtype), or when the deployment has an auth
token and the worker's HMAC of its id does not match it.

Every frame, not only Hello, is authenticated: :mod:`epdserve.serving.auth` seals each
one with a tag under the token and the receiver drops a frame whose tag does not verify
before it parses it, so with a token only token holders ever reach :func:`refusal`; the
Hello's ``auth`` field is checked on top (it proves the id, as before). Who may take over
a worker id that is already held is the router's rule (``Registry.on_hello``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from pathlib import Path

from epdserve.serving.protocol import PROTOCOL_VERSION

KV_PEER_ROLES = {"prefill": "decode", "decode": "prefill"}


def model_fingerprint(path: Path) -> str:
    """A short hash of a Hugging Face directory's config.json and of every safetensors
    file's header (tensor names, dtypes, shapes, offsets), not of the weights' bytes, so
    that it costs milliseconds.

    Raises:
        OSError: a file cannot be read.
    """
    h = hashlib.sha256(Path(path, "config.json").read_bytes())
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(fh.read(n))
    return h.hexdigest()[:16]


def model_kv_shape(path: Path) -> dict:
    """``num_layers``, ``num_kv_heads`` and ``head_dim`` of the model in ``path``
    (the part of a KV layout fixed by the model; a vision-language model's language model's)."""
    c = json.loads(Path(path, "config.json").read_text())
    c = c.get("text_config", c)
    heads = c["num_attention_heads"]
    return {"num_layers": c["num_hidden_layers"], "num_kv_heads": c.get("num_key_value_heads", heads),
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads}


def auth_tag(token: str | None, worker_id: str) -> str:
    """HMAC-SHA256 of ``worker_id`` under ``token`` (hex); "" when there is no token."""
    if not token:
        return ""
    return hmac.new(token.encode(), worker_id.encode(), hashlib.sha256).hexdigest()


def refusal(hello, *, fingerprint: str, kv_shape: dict, auth_token: str | None,
            peers: list[tuple[str, dict]]) -> str | None:
    """Why ``hello`` (a :class:`~epdserve.serving.protocol.Hello`) must be refused, or None.

    ``fingerprint`` and ``kv_shape`` are the router's model's; ``peers`` the
    ``(worker_id, kv_layout)`` of the live workers it may exchange KV with (PD: of the
    other role; elastic: every other engine worker), whose layouts may differ from
    ``hello``'s in ``dtype`` only.
    """
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
