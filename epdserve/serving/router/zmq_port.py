"""The router's ZeroMQ side: a sealed, monitored PUSH socket per worker (the production
:class:`~epdserve.serving.router.registry.WorkerPort`) and the events socket's reading loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from epdserve.serving import auth
from epdserve.serving import protocol as P
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.registry import Registry
from epdserve.transfer.sealing import AuthError, DropLog, Sealer

log = logging.getLogger("epdserve.router")

MAX_EVENT_BYTES = 16 << 20  # a worker frame larger than this is dropped by ZeroMQ
EVENTS_POLL_S = 0.5
STALL_GRACE_S = 0.5  # of one loop turn beyond a poll, the most that counts as read clock
MAX_EVENTS_BATCH = 1000
SILENCE_CHECK_S = 1.0  # read-clock seconds
ONCE_LINGER_MS = 2000  # deliver a Refused or Reset to a worker without a channel, never blocking for long


class ZmqPort:
    """``keyring`` seals commands and sets CURVE on TCP."""

    def __init__(self, keyring: auth.Keyring):
        self.keyring = keyring
        self._ctx = zmq.Context()
        self._socks: dict[str, tuple[zmq.Socket, Sealer]] = {}
        self._monitors: dict[str, list] = {}  # worker id -> [its socket's monitor, connected yet]

    def connect(self, worker_id: str, addr: str, incarnation: str) -> None:
        self.disconnect(worker_id)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        self.keyring.secure_client(sock, addr)
        self._monitors[worker_id] = [sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED), False]
        sock.connect(addr)
        self._socks[worker_id] = (sock, self.keyring.sealer("commands", incarnation))

    def disconnect(self, worker_id: str) -> None:
        """Drops what is still queued."""
        entry = self._socks.pop(worker_id, None)
        monitor = self._monitors.pop(worker_id, None)
        if entry is not None:
            entry[0].disable_monitor()
            monitor[0].close(linger=0)
            entry[0].close(linger=0)

    def lost(self) -> list[str]:
        """Workers whose established command connection closed since the last call (a dead process,
        kill -9 included, or host); a live one reconnects by itself and is heard again."""
        gone = []
        for worker_id, entry in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(entry[0], zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_CONNECTED:
                    entry[1] = True
                elif event == zmq.EVENT_DISCONNECTED and entry[1]:
                    entry[1] = False
                    gone.append(worker_id)
        return gone

    def send(self, worker_id: str, msg) -> None:
        """Never blocks. Raises WorkerFailed: its command queue is full, or it has no socket."""
        entry = self._socks.get(worker_id)
        if entry is None:
            raise WorkerFailed(f"worker {worker_id} is not connected")
        sock, sealer = entry
        try:
            sock.send(sealer.seal(P.encode(msg)), zmq.NOBLOCK)
        except zmq.Again:
            raise WorkerFailed(f"worker {worker_id} is not accepting commands") from None

    def send_once(self, worker_id: str, addr: str, msg: P.Refused | P.Reset) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, ONCE_LINGER_MS)
        self.keyring.secure_client(sock, addr)
        frame = self.keyring.sealer("commands", msg.incarnation).seal(P.encode(msg))
        try:
            sock.connect(addr)
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again included
            log.warning("could not send %s to %s at %s: %s", msg.type, worker_id, addr, exc)
        finally:
            sock.close()

    def close(self) -> None:
        for worker_id in list(self._socks):
            self.disconnect(worker_id)


class EventsLoop:
    """Raises (:meth:`bind`): zmq.ZMQError if the address is taken."""

    def __init__(self, registry: Registry, keyring: auth.Keyring, addr: str, port: ZmqPort | None = None):
        self.registry = registry
        self.port = port
        self.keyring = keyring
        self.addr = addr
        self._opener = keyring.opener("events")
        self._drops = DropLog(log, "dropped a frame on the events socket")
        self._actx = zmq.asyncio.Context()
        self._pull: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    def bind(self) -> None:
        """Idempotent."""
        if self._pull is None:
            self._pull = self._actx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
            self._pull.setsockopt(zmq.LINGER, 0)
            self.keyring.secure_server(self._pull, self.addr)
            self._pull.bind(self.addr)

    async def start(self) -> None:
        self.bind()
        self._task = asyncio.create_task(self._run(), name="epdserve-router-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None

    async def _run(self) -> None:
        """Silence counts on the read clock, not the wall clock: a turn beyond ``EVENTS_POLL_S +
        STALL_GRACE_S`` (a stalled loop) counts no more, and queued heartbeats are read first."""
        registry = self.registry
        last_turn = time.monotonic()
        last_check = registry.clock
        while True:
            ready = await self._pull.poll(EVENTS_POLL_S * 1000)
            now = time.monotonic()
            registry.advance(min(now - last_turn, EVENTS_POLL_S + STALL_GRACE_S))
            last_turn = now
            drained = True
            if ready:
                for _ in range(MAX_EVENTS_BATCH):
                    self._on_frame(await self._pull.recv(), now)
                    if not self._pull.get(zmq.EVENTS) & zmq.POLLIN:
                        break
                else:
                    drained = False  # more queued: read them before judging anyone silent
            if drained and registry.clock - last_check >= SILENCE_CHECK_S:
                last_check = registry.clock
                for worker_id in self.port.lost() if self.port else ():
                    registry.mark_dead(worker_id, "its connection closed (its process or host is gone)")
                registry.check_silence()

    def _on_frame(self, frame: bytes, now: float) -> None:
        """A frame that fails is dropped (logged, rate-limited)."""
        try:
            msg = P.decode(self._opener.open(frame))
        except AuthError as exc:
            self._drops(f"it failed authentication: {exc}")
            return
        except P.ProtocolError as exc:
            self._drops(f"bad frame: {exc}")
            return
        try:
            self.registry.on_message(msg, now)
        except Exception:
            log.exception("error handling a worker message")
