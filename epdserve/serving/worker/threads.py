"""The threads around a worker's loop: one receives the router's commands, one sends heartbeats."""

from __future__ import annotations

import logging
import queue
import threading
import time

import zmq

from epdserve.serving import auth
from epdserve.serving import protocol as P
from epdserve.transfer.sealing import AuthError, DropLog, NO_AUTH, Opener

log = logging.getLogger("epdserve.worker")
HEARTBEAT_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.1  # an idle worker's wait for a command before its housekeeping


def receive_commands(cmd: zmq.Socket, inbox: queue.Queue, worker_id: str, stop: threading.Event,
                     opener: Opener | None = None) -> None:
    """Put each command into ``inbox`` as ``(message, time.perf_counter() at receipt)``, so that
    the wait behind a long engine step counts as queue time, until ``stop``. Frames that fail
    ``opener``'s check or do not decode are dropped (logged, rate-limited)."""
    opener = opener or NO_AUTH.opener("commands")
    drops = DropLog(log, f"{worker_id}: dropped a command frame")
    while not stop.is_set():
        if not cmd.poll(IDLE_WAIT_S * 1000):
            continue
        frame = cmd.recv()
        arrival = time.perf_counter()
        try:
            inbox.put((P.decode(opener.open(frame)), arrival))
        except AuthError as exc:
            drops(f"it failed authentication: {exc}")
        except P.ProtocolError as exc:
            drops(f"it is not an epdserve message: {exc}")


def heartbeat(ctx: zmq.Context, router: str, worker_id: str, stop: threading.Event,
              keyring: auth.Keyring = NO_AUTH, incarnation: str = "0" * 16, addr: str = "") -> None:
    """A Heartbeat every HEARTBEAT_INTERVAL_S until ``stop``, on a socket of its own; each sealed
    anew so that a recorded beat cannot be replayed. ``addr``: the worker's command address."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # a router that is away gets a few, not a backlog
    keyring.secure_client(sock, router)
    sock.connect(router)
    sealer = keyring.sealer("events")
    body = P.encode(P.Heartbeat(worker_id=worker_id, incarnation=incarnation, addr=addr))
    while not stop.wait(HEARTBEAT_INTERVAL_S):
        try:
            sock.send(sealer.seal(body), zmq.NOBLOCK)
        except zmq.Again:
            pass
    sock.close()


def serve(worker, ctx: zmq.Context, cmd: zmq.Socket, inbox: queue.Queue, router: str, worker_id: str,
          keyring: auth.Keyring, incarnation: str) -> None:
    stop = threading.Event()
    beat = threading.Thread(target=heartbeat, name="epdserve-heartbeat", daemon=True,
                            args=(ctx, router, worker_id, stop, keyring, incarnation, worker.hello.addr))
    # Commands open only with this process's incarnation: none meant for another opens here.
    receiver = threading.Thread(target=receive_commands, name="epdserve-commands", daemon=True,
                                args=(cmd, inbox, worker_id, stop, keyring.opener("commands", incarnation)))
    beat.start()
    receiver.start()
    try:
        worker.loop()
    finally:
        stop.set()
        beat.join()
        receiver.join()
