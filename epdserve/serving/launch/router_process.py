"""``serve``'s router in a process of its own (``--cluster local``): serve restarts it when it dies,
and the workers keep their engines and join the new one (docs/serving.md, "When the router dies").

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

import pydantic
import uvicorn

from epdserve.host import ROUTER_MODULE
from epdserve.model.loader import ModelLoadError
from epdserve.serving.launch.children import EXIT_CONFIG
from epdserve.serving.router import Router, build_router, create_app, setup_logging
from epdserve.serving.router.http_guard import uvicorn_config
from epdserve.serving.router.options import RouterOptions

log = logging.getLogger("epdserve.launcher")

ROUTER_ID = "router"  # its name among serve's children (host.child_pids names it so too)
SETUP_ENV = "EPDSERVE_ROUTER_SETUP"  # the environment, not argv: the setup holds the auth token
READY_CHECK_S = 0.2
REJOIN_WAIT_S = 10.0  # a restarted router's wait for its workers before it accepts connections


@dataclass(frozen=True)
class RouterSetup:
    """What the router process is started with. ``listen_fd`` and ``link_fd``: serve's listening
    HTTP socket and its end of the link, inherited; ``workers``: the placement's worker ids;
    ``min_workers``..``max_workers``: the elastic bounds; ``startup_timeout`` (s) of a worker added;
    ``rejoin_s``: how long it waits for the placement's workers to join before it accepts connections
    (a restarted router: they are up, and serve's socket holds the connections meanwhile; 0 at the
    first start, where ``/health`` answers while they load)."""
    options: RouterOptions
    events: str
    listen_fd: int
    link_fd: int
    workers: tuple[str, ...]
    min_workers: int
    max_workers: int
    startup_timeout: float
    rejoin_s: float = 0.0


def command(setup: RouterSetup) -> tuple[list[str], dict[str, str]]:
    """``(argv, environment)`` of a router process."""
    body = pydantic.TypeAdapter(RouterSetup).dump_json(setup).decode()
    return [sys.executable, "-m", ROUTER_MODULE], {SETUP_ENV: body}


def link_pair() -> tuple[socket.socket, socket.socket]:
    """``(serve's end, the router's end)``: each packet one message, whole."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(link: socket.socket, **message) -> None:
    """Dropped, not blocking, when the other end is not reading (a router restarting)."""
    try:
        link.send(json.dumps(message).encode(), socket.MSG_DONTWAIT)
    except (BlockingIOError, OSError) as exc:
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


async def _serve(server: uvicorn.Server, router: Router, link: socket.socket, workers: tuple[str, ...],
                 listen: socket.socket) -> None:
    def on_link() -> None:
        for message in received(link):
            w = router.workers.get(message["worker"])
            if message["event"] == "down" and w is not None and w.pid == message["pid"]:
                router.mark_dead(w.worker_id, message["why"])

    asyncio.get_running_loop().add_reader(link.fileno(), on_link)
    serving = asyncio.create_task(server.serve(sockets=[listen]))
    while not serving.done():
        if server.started and _joined(router, workers):
            send(link, event="ready")
            break
        await asyncio.sleep(READY_CHECK_S)
    await serving


def main() -> int:
    """The router process: exit status EXIT_CONFIG when its model or options are refused."""
    setup = pydantic.TypeAdapter(RouterSetup).validate_json(os.environ.pop(SETUP_ENV))
    setup_logging(setup.options.log_level)
    link = socket.socket(fileno=setup.link_fd)
    try:
        router = build_router(setup.options, setup.events)
    except (ModelLoadError, ValueError) as exc:
        print(f"epdserve serve: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    if setup.options.elastic.elastic:
        router.enable_scaling(None, setup.min_workers, setup.max_workers, setup.startup_timeout)
    options = setup.options
    app = _accepting_after(create_app(router), router, setup.workers, setup.rejoin_s)
    server = uvicorn.Server(uvicorn_config(app, options.host, options.port, options.http, lifespan="on",
                                           timeout_graceful_shutdown=5))
    log.info("router (pid %d) serving; workers join on %s", os.getpid(), setup.events)
    asyncio.run(_serve(server, router, link, setup.workers, socket.socket(fileno=setup.listen_fd)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
