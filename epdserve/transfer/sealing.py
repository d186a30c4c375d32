"""Sealing of internal frames: the HMAC trailer (``body | stream 8 B | seq 8 B big-endian | tag 32 B``), its
checks, per-purpose keys and CURVE pairs derived from the token, and a rate-limited drop log. The scheme
and its limits: docs/architecture.md (Sealing) and ``serving/auth.py``."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time
from collections import OrderedDict

import zmq

STREAM_BYTES = 8
SEQ_BYTES = 8
TAG_BYTES = 32
OVERHEAD = STREAM_BYTES + SEQ_BYTES + TAG_BYTES
MAX_STREAMS = 1024  # senders a receiver remembers for the replay check (least recently heard forgotten)
ENCRYPTIONS = ("none", "curve")
_LABEL = b"epdserve/v1/"


class AuthError(ValueError):
    """A frame whose tag does not verify (no token, another token, altered), or a replay."""


class Sealer:
    """One sending socket (its own ``stream`` and counter); no key: frames unchanged. One thread at a time."""

    def __init__(self, key: bytes | None, bind: str = ""):
        self._key = key
        self._bind = bind.encode()
        self._stream = os.urandom(STREAM_BYTES)
        self._seq = 0

    def seal(self, body: bytes) -> bytes:
        if self._key is None:
            return body
        self._seq += 1
        head = self._stream + struct.pack(">Q", self._seq)
        mac = hmac.new(self._key, self._bind + head, hashlib.sha256)
        mac.update(body)
        return body + head + mac.digest()


class Opener:
    """``replay_check``: drop a counter not above its stream's last (off where each sender is a fresh
    connection). No key: frames unchanged."""

    def __init__(self, key: bytes | None, bind: str = "", replay_check: bool = True):
        self._key = key
        self._bind = bind.encode()
        self._replay_check = replay_check
        self._streams: OrderedDict[bytes, int] = OrderedDict()

    def open(self, frame: bytes) -> memoryview | bytes:
        """The body (a view) once its tag verifies in constant time. Raises AuthError: too short, bad tag, replay."""
        if self._key is None:
            return frame
        if len(frame) < OVERHEAD:
            raise AuthError(f"frame of {len(frame)} bytes carries no tag")
        view = memoryview(frame)
        body, head, tag = view[:-OVERHEAD], bytes(view[-OVERHEAD:-TAG_BYTES]), view[-TAG_BYTES:]
        mac = hmac.new(self._key, self._bind + head, hashlib.sha256)
        mac.update(body)
        if not hmac.compare_digest(mac.digest(), bytes(tag)):
            raise AuthError("bad tag (another or no auth token, or an altered frame)")
        if self._replay_check:
            stream, (seq,) = head[:STREAM_BYTES], struct.unpack(">Q", head[STREAM_BYTES:])
            last = self._streams.get(stream)
            if last is not None and seq <= last:
                raise AuthError(f"replayed or reordered frame (counter {seq}, last {last})")
            self._streams[stream] = seq
            self._streams.move_to_end(stream)
            if len(self._streams) > MAX_STREAMS:
                self._streams.popitem(last=False)
        return body


class Keyring:
    """Per-purpose MAC keys and, with ``curve``, CURVE key pairs, from the token (None or "": no auth). Raises
    ValueError: ``curve`` without a token or without libzmq CURVE support."""

    def __init__(self, token: str | None, curve: bool = False):
        if curve and not token:
            raise ValueError("--internal-encryption curve needs an auth token (its keys derive from it)")
        if curve and not zmq.has("curve"):
            raise ValueError("--internal-encryption curve: this libzmq has no CURVE support")
        self._root = hashlib.sha256(token.encode()).digest() if token else None
        self.curve = curve
        if curve:
            self._server = self._curve_pair("curve-server")
            self._client = self._curve_pair("curve-client")

    @property
    def enabled(self) -> bool:
        return self._root is not None

    def key(self, label: str) -> bytes | None:
        if self._root is None:
            return None
        return hmac.new(self._root, _LABEL + label.encode(), hashlib.sha256).digest()

    def sealer(self, purpose: str, bind: str = "") -> Sealer:
        return Sealer(self.key(purpose), bind)

    def opener(self, purpose: str, bind: str = "", replay_check: bool = True) -> Opener:
        return Opener(self.key(purpose), bind, replay_check)

    def _curve_pair(self, label: str) -> tuple[bytes, bytes]:
        from zmq.utils import z85

        secret = z85.encode(self.key(label))
        return zmq.curve_public(secret), secret

    def secure_server(self, sock: zmq.Socket, addr: str) -> None:
        """A CURVE server if encryption is on and ``addr`` is TCP."""
        if self.curve and addr.startswith("tcp://"):
            sock.curve_publickey, sock.curve_secretkey = self._server
            sock.curve_server = True

    def secure_client(self, sock: zmq.Socket, addr: str) -> None:
        """A CURVE client if encryption is on and ``addr`` is TCP."""
        if self.curve and addr.startswith("tcp://"):
            sock.curve_serverkey = self._server[0]
            sock.curve_publickey, sock.curve_secretkey = self._client


NO_AUTH = Keyring(None)


class DropLog:
    """The first drop at once, then at most one line per ``interval_s`` (a flood must not fill the disk)."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0):
        self.logger, self.what, self.interval_s = logger, what, interval_s
        self.count = 0  # dropped in all
        self._unlogged = 0
        self._last = -float("inf")

    def __call__(self, reason: object) -> None:
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            more = f" ({self._unlogged - 1} more since the last report)" if self._unlogged > 1 else ""
            self.logger.warning("%s: %s%s", self.what, reason, more)
            self._last, self._unlogged = now, 0
