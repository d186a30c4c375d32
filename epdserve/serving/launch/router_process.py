"""``serve``'s router in a process of its own (``--cluster local``), forked from serve with its
checked inputs: serve restarts it when it dies, and the workers keep their engines and join the
new one (docs/serving.md, "When the router dies").

The two processes share a sequenced-packet socket pair, one JSON object per packet. The router
says ``{"event": "ready"}`` once every worker of the placement is live; serve says ``{"event":
"down", "worker": id, "pid": pid, "why": text}`` when a worker's process exits, so that its
requests move at once instead of after the command connection's check."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass

import uvicorn

from epdserve.serving.launch.children import EXIT_CONFIG
from epdserve.serving.router import Router, create_app
from epdserve.serving.router.app import RouterInputs, router_from
from epdserve.serving.router.http_guard import uvicorn_config
from epdserve.serving.router.options import RouterOptions

log = logging.getLogger("epdserve.launcher")

ROUTER_ID = "router"  # its name among serve's children (host.child_pids names it so too)
READY_CHECK_S = 0.2
REJOIN_WAIT_S = 10.0  # a restarted router's wait for its workers before it accepts connections


@dataclass(frozen=True)
class RouterSetup:
    """What the router process serves with: ``listen``, serve's listening HTTP socket; ``link``, its
    end of the link; ``workers``, the placement's worker ids; ``min_workers``..``max_workers``, the
    elastic bounds; ``startup_timeout`` (s) of a worker added."""
    options: RouterOptions
    inputs: RouterInputs
    events: str
    listen: socket.socket
    link: socket.socket
    workers: tuple[str, ...]
    min_workers: int
    max_workers: int
    startup_timeout: float


def link_pair() -> tuple[socket.socket, socket.socket]:
    """``(serve's end, the router's end)``: each packet one message, whole."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(link: socket.socket, **message) -> None:
    """Dropped, not blocking, when the other end is not reading (a router restarting)."""
    try:
        link.send(json.dumps(message).encode(), socket.MSG_DONTWAIT)
    except OSError as exc:
        log.warning("link to the router: %s not sent: %s", message.get("event"), exc)


def received(link: socket.socket) -> list[dict]:
    """Every message waiting on ``link``, not blocking."""
    out = []
    while True:
        try:
            packet = link.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return out
        if not packet:
            return out
        out.append(json.loads(packet))


def _joined(router: Router, workers: tuple[str, ...]) -> bool:
    return all(w in router.workers and router.live(router.workers[w]) for w in workers)


def _accepting_after(app, router: Router, workers: tuple[str, ...], wait_s: float):
    """``app`` whose lifespan startup (after which uvicorn accepts connections) ends once ``workers``
    have joined, or after ``wait_s``."""
    async def wait() -> None:
        deadline = asyncio.get_running_loop().time() + wait_s
        while not _joined(router, workers) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    async def wrapped(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def send_after_join(message):
            if message["type"] == "lifespan.startup.complete":
                await wait()
            await send(message)
        return await app(scope, receive, send_after_join)
    return wrapped


async def _serve(server: uvicorn.Server, router: Router, setup: RouterSetup) -> None:
    def on_link() -> None:
        for message in received(setup.link):
            w = router.workers.get(message["worker"])
            if message["event"] == "down" and w is not None and w.pid == message["pid"]:
                router.mark_dead(w.worker_id, message["why"])

    asyncio.get_running_loop().add_reader(setup.link.fileno(), on_link)
    serving = asyncio.create_task(server.serve(sockets=[setup.listen]))
    while not serving.done():
        if server.started and _joined(router, setup.workers):
            send(setup.link, event="ready")
            break
        await asyncio.sleep(READY_CHECK_S)
    await serving


def run(setup: RouterSetup, restarted: bool) -> int:
    """The router process's life, in the child serve forked (exit status 0; EXIT_CONFIG when the
    router refuses its settings). ``restarted``: it
    waits up to REJOIN_WAIT_S for the placement's workers, which are up, before it accepts
    connections (serve's socket holds them meanwhile); the first start accepts at once, so that
    ``/health`` answers while the workers load."""
    options = setup.options
    try:
        router = router_from(options, setup.events, setup.inputs)
    except ValueError as exc:  # CURVE without libzmq's support
        print(f"epdserve serve: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if options.elastic.elastic:
        router.enable_scaling(None, setup.min_workers, setup.max_workers, setup.startup_timeout)
    app = _accepting_after(create_app(router), router, setup.workers, REJOIN_WAIT_S if restarted else 0.0)
    server = uvicorn.Server(uvicorn_config(app, options.host, options.port, options.http, lifespan="on",
                                           timeout_graceful_shutdown=5))
    log.info("router (pid %d) serving; workers join on %s", os.getpid(), setup.events)
    asyncio.run(_serve(server, router, setup))
    return 0
