"""KV over TCP (ZeroMQ) across hosts: a DEALER sends msgpack ``{"request_id", "name"}`` sealed with the
``kv-request`` key; the ROUTER drops it unanswered if the tag fails, else replies ``[b"ok", frame]`` or
``[b"error", message]``, unsealed (docs/architecture.md, Sealing). Keys default to :func:`configure`'s."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgpack
import torch
import zmq

from epdserve.transfer.sealing import NO_AUTH, AuthError, DropLog, Keyring
from epdserve.transfer.wire import TensorHeader, WireError, parse

log = logging.getLogger("epdserve.transfer.tcp")
MAX_REQUEST_BYTES = 4096
REPLY_SLACK_BYTES = 1024  # libzmq checks the size of a message as received: CURVE's box adds to it
POLL_MS = 100
_keyring: Keyring = NO_AUTH  # this process's, see configure()


def configure(keyring: Keyring) -> None:
    """Call once, before making any server or fetch."""
    global _keyring
    _keyring = keyring


class KVServer:
    """Serves on its own thread (a CPU prefill step takes seconds); ``source(request_id, name)`` only reads and
    returns a buffer or raises WireError (sent back). Port 0: a free one (:attr:`addr`). Raises zmq.ZMQError."""

    def __init__(self, ctx: zmq.Context, bind: str, source: Callable[[str, str], object],
                 keyring: Keyring | None = None):
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-1] + "*"
        keyring = keyring or _keyring
        self.source = source
        # Every request is a fresh connection, so a counter per sender would check nothing.
        self.opener = keyring.opener("kv-request", replay_check=False)
        self.drops = DropLog(log, "dropped a KV request")
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        keyring.secure_server(self.sock, bind)
        self.sock.bind(bind)
        self.addr: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epdserve-kv-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Within ``POLL_MS``."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(POLL_MS):
                self._serve_one()
        self.sock.close()

    def _serve_one(self) -> None:
        parts = self.sock.recv_multipart()
        if len(parts) != 2:
            log.warning("dropped a KV request of %d frames", len(parts))
            return
        identity, body = parts
        try:
            body = self.opener.open(body)
        except AuthError as exc:
            self.drops(exc)  # no answer: the sender proved nothing
            return
        try:
            request_id, name = _parse_request(body)
            frame = self.source(request_id, name)
        except WireError as exc:
            self.sock.send_multipart([identity, b"error", str(exc).encode()])
            return
        # copy=False: libzmq sends straight from the buffer, which pyzmq keeps alive until sent.
        self.sock.send_multipart([identity, b"ok", frame], copy=False)


def _parse_request(body: bytes) -> tuple[str, str]:
    try:
        req = msgpack.unpackb(body, raw=False)
    except Exception:  # msgpack raises several unrelated types
        raise WireError("KV request is not msgpack") from None
    if (not isinstance(req, dict) or set(req) != {"request_id", "name"}
            or not all(isinstance(v, str) for v in req.values())):
        raise WireError("KV request must be {request_id: str, name: str}")
    return req["request_id"], req["name"]


def fetch(ctx: zmq.Context, addr: str, request_id: str, name: str, nbytes: int, timeout_s: float,
          cancel: threading.Event | None = None,
          keyring: Keyring | None = None) -> tuple[TensorHeader, dict[str, torch.Tensor]]:
    """Header and tensors (read-only views). A fresh socket per fetch, so a late reply to an earlier one is never
    taken; a wrongly sealed request times out. Raises WireError: timeout, ``cancel``, error reply, wrong size."""
    keyring = keyring or _keyring
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(nbytes, MAX_REQUEST_BYTES) + REPLY_SLACK_BYTES)
    try:
        keyring.secure_client(sock, addr)
        sock.connect(addr)
        request = msgpack.packb({"request_id": request_id, "name": name}, use_bin_type=True)
        sock.send(keyring.sealer("kv-request").seal(request))
        deadline = time.monotonic() + timeout_s
        # Wait in slices: an abort or a stopping worker frees the thread within POLL_MS.
        while not sock.poll(max(0.0, min(POLL_MS, (deadline - time.monotonic()) * 1000))):
            if cancel is not None and cancel.is_set():
                raise WireError(f"KV fetch for request {request_id} cancelled")
            if time.monotonic() >= deadline:
                raise WireError(f"no KV from {addr} for request {request_id} within {timeout_s:g} s")
        parts = sock.recv_multipart(copy=False)
    finally:
        sock.close()
    status = parts[0].bytes if parts else b""
    if len(parts) != 2 or status not in (b"ok", b"error"):
        raise WireError(f"KV reply from {addr} is not [status, body] ({len(parts)} frames)")
    if status == b"error":
        raise WireError(f"KV server {addr}: {parts[1].bytes[:500].decode(errors='replace')}")
    frame = parts[1].buffer
    if len(frame) != nbytes:
        raise WireError(f"KV reply from {addr} is {len(frame)} bytes, expected {nbytes}")
    return parse(frame)
