"""KV hand-off across hosts over TCP (ZeroMQ): a prefill worker serves a request's KV, as
one wire frame, to decode workers that cannot map its shared memory: a segment it wrote to
/dev/shm (:mod:`epdserve.transfer.shm`), or a frame built on request from blocks it holds.

Exchange (one per hand-off, nothing is ever unpickled):

* the decode worker's DEALER sends one frame, msgpack ``{"request_id": str, "name": str}``
  sealed with the deployment's ``kv-request`` key (:mod:`epdserve.transfer.sealing`, scheme in
  :mod:`epdserve.serving.auth`);
* the prefill worker's ROUTER checks the tag first and drops (unanswered, logged
  rate-limited) a request that fails it; else it answers ``[b"ok", frame]`` (one wire
  frame, sent without a further copy from a segment's mapping or a freshly built buffer)
  or ``[b"error", utf-8 message]``. The reply is not sealed (why: ``auth``'s module doc);
  with ``--internal-encryption curve`` both sockets use CURVE, which encrypts it.

The receiver caps the reply at the size the descriptor announced and parses it with
:func:`epdserve.transfer.wire.parse`, so a reply that is not our frame raises
:class:`~epdserve.transfer.wire.WireError`.

The keys come from a :class:`~epdserve.transfer.sealing.Keyring` passed in, or else the one a
worker process installs with :func:`configure` at start (its exporter and importer make
servers and fetches without naming one); none: no authentication, as before.
"""

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
    """Use ``keyring`` for every later server and fetch of this process that names none
    (a worker calls it once, before it makes any)."""
    global _keyring
    _keyring = keyring


class KVServer:
    """A thread with its own ROUTER socket bound at ``bind`` (``tcp://HOST:PORT``; port
    ``*`` or 0 picks a free one, see :attr:`addr`) that sends a segment to whoever names
    it: ``source(request_id, name)`` returns the frame to send (any buffer: bytes, mmap,
    bytearray) or raises :class:`WireError`, whose message goes back as the error.
    ``keyring``: whose sealed requests it answers (default: the process's, :func:`configure`).

    A thread rather than the worker loop because a CPU prefill step of a long prompt takes
    seconds and a fetch served between steps would wait that long; ``source`` only reads
    (torch releases the GIL while the engine computes) and changes no engine state.

    Raises (constructor): ``zmq.ZMQError`` if ``bind`` cannot be bound.
    """

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
        """Stop serving and close the socket (within ``POLL_MS``)."""
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
    """Fetch segment ``name`` of ``request_id`` (a frame of ``nbytes`` bytes) from the KV
    server at ``addr``; returns its header and tensors by name (read-only views of the
    received message, no copy). Blocks at most ``timeout_s`` seconds, or until ``cancel``
    is set (checked every ``POLL_MS``). ``keyring``: seals the request (default: the
    process's, :func:`configure`); a server that does not take its tag does not answer,
    which reads as a timeout.

    A fresh socket per fetch, so a late reply to an earlier, timed-out fetch can never be
    taken for this one. Safe to call from any thread (the socket is its own).

    Raises:
        WireError: no complete reply within ``timeout_s``, ``cancel`` set, an error reply,
            or a reply that is not a frame of ``nbytes`` bytes.
    """
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
        # Wait in slices so that an aborted request (or a stopping worker) frees the
        # waiting thread within POLL_MS instead of after the whole timeout.
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
