"""``epdserve serve``: the router in this process and its workers, started and stopped together.
Placement, capacity checks and restarts: docs/serving.md; ``--cluster ray``: docs/ray.md."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import errno
import logging
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import replace

import uvicorn

from epdserve import extras, host
from epdserve.argtypes import add_flags
from epdserve.model.loader import ModelLoadError
from epdserve.serving import auth
from epdserve.serving.launch import ray_cluster
from epdserve.serving.launch import router_process
from epdserve.serving.launch.children import Children
from epdserve.serving.deployment import Placement
from epdserve.serving.launch.options import ServeOptions
from epdserve.serving.launch.placement import checked_plan, plan_for, usable_cores  # noqa: F401 (serve's API)
from epdserve.serving.router.http_guard import uvicorn_config
from epdserve.serving.worker.setup import worker_argv
from epdserve.serving.router import SYNTHETIC_VISION_NOTE, Router, build_router, create_app, setup_logging
from epdserve.serving.router.app import RouterInputs, router_inputs

log = logging.getLogger("epdserve.launcher")

ROLE_DEVICES = ("prefill", "decode", "encode")  # the roles with a --ROLE-device of their own


OPTIONS = ServeOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """:class:`ServeOptions`' flags. A worker flag is the worker's declaration, so a bad value stops
    serve (exit 2), not every worker; unset, a worker keeps its own default."""
    add_flags(parser, ServeOptions)


def check_capacity(options: ServeOptions, plan: Placement, model_dir: str,
                   available_bytes: int | None) -> tuple[list[str], str | None]:
    """``(warnings, error)``, error None when ``plan`` fits in ``available_bytes``
    (MemAvailable; None: not checked). The estimate: docs/serving.md, "Placement and capacity"."""
    warnings = []
    per_core: dict[int, int] = {}
    for _, _, cores in plan:
        for c in cores:
            per_core[c] = per_core.get(c, 0) + 1
    shared = sorted(c for c, n in per_core.items() if n > 1)
    if shared:
        warnings.append(f"{len(plan)} workers on {len(per_core)} cores: cores {','.join(map(str, shared))} are "
                        f"each shared by several workers, which slow each other down (fewer workers or more "
                        f"cores avoid it)")
    if available_bytes is None:
        return warnings, None
    kv_mb = options.kv_cache_memory_mb
    weights = host.weight_bytes(model_dir)
    ranks = options.tp_sizes()
    host_kv = [(role != "encode" and (role_device(options, role) or "cpu") == "cpu") * ranks[role]
               for role, _, _ in plan]
    need = sum(weights + kv_mb * 2**20 * kv for kv in host_kv)
    if need <= available_bytes:
        return warnings, None
    exempt = "; encode and GPU workers: no KV cache in host memory" if not all(host_kv) else ""
    per = "worker rank" if max(ranks.values()) > 1 else "worker"
    fact = (f"{len(plan)} workers need about {need / 2**30:.1f} GiB ({weights / 2**30:.2f} GiB of weights + "
            f"{kv_mb} MiB of KV cache per {per}{exempt}) but {available_bytes / 2**30:.1f} GiB is available "
            f"(MemAvailable)")
    if options.allow_oversubscription:
        return warnings + [fact + "; starting anyway (--allow-oversubscription)"], None
    return warnings, fact


def listen_socket(host_name: str, port: int) -> socket.socket:
    """Bound and listening now, so that a busy port stops serve before it loads a model.

    Raises:
        OSError: the address is in use, not local, or the host unknown.
        OverflowError: a port outside 0..65535.
    """
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only then; else Nagle's algorithm waits for the
    # client's delayed ACK, +40 ms on each request of a kept-alive connection.
    sock = socket.socket(socket.AF_INET6 if ":" in host_name else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host_name, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def role_device(options: ServeOptions, role: str) -> str | None:
    """``--ROLE-device``, else ``--device``; None: neither given (the worker's default, the CPU)."""
    return options.role(role).device or options.worker.get("device")


def worker_flags(options: ServeOptions, role: str, worker_id: str, events: str) -> list[str]:
    """serve's per-role flags (``--prefill-dtype``, ``--decode-device``, ``--prefill-tp``, ...) as
    the worker's own (``--dtype``, ``--device``, ``--tensor-parallel-size``)."""
    own, given = options.role(role), options.worker
    ranks = options.tp_sizes()[role]
    return ["--role", role, "--router", events, "--worker-id", worker_id, *(["--elastic"] if options.elastic else []),
            *worker_argv(dict(given, model=options.router.model, dtype=own.dtype or given.get("dtype"),
                              weight_format=own.weight_format or given.get("weight_format"),
                              kv_cache_dtype=own.kv_cache_dtype or given.get("kv_cache_dtype"),
                              device=role_device(options, role), tensor_parallel_size=ranks if ranks > 1 else None))]


def worker_command(options: ServeOptions, role: str, worker_id: str, cores: list[int],
                   events: str, cmd: str) -> list[str]:
    return [sys.executable, "-m", "epdserve", "worker", *worker_flags(options, role, worker_id, events),
            "--bind", cmd, "--cores", ",".join(map(str, cores))]


def worker_env(options: auth.AuthOptions) -> dict[str, str]:
    """The security options by environment: argv is readable by any local user."""
    env = {"EPDSERVE_INTERNAL_ENCRYPTION": options.internal_encryption,
           "EPDSERVE_ALLOW_UNAUTHENTICATED": "1" if options.allow_unauthenticated else "0"}
    if options.auth_token:
        env["EPDSERVE_AUTH_TOKEN"] = options.auth_token
    return env


def _announce(options: ServeOptions, sock: socket.socket, model, placement: str, again: bool = False) -> None:
    port = sock.getsockname()[1]
    print(f"epdserve serve: {'the router is back: ' if again else ''}ready at http://{options.router.host}:{port} "
          f"(mode {options.router.mode}, model {model.name}; {placement})", flush=True)
    if model.synthetic_vision and not again:
        print(f"epdserve serve: note: {SYNTHETIC_VISION_NOTE}", flush=True)


def _worker_exit(wid: str, why: str, fatal: bool, note: str) -> None:
    msg = f"epdserve serve: worker {wid}: {why}; " + ("stopping (its configuration is wrong)" if fatal else note)
    log.error(msg)
    print(msg, file=sys.stderr, flush=True)


async def _supervise(server, router: Router, children, options: ServeOptions, placement: str,
                     sock: socket.socket) -> int:
    """``--cluster ray``, the router in this process. Returns 1 after a fatal worker exit (EXIT_CONFIG)
    or a startup timeout, 0 after a signal."""
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    rc = 0
    announced = False
    deadline = time.monotonic() + options.startup_timeout
    while not serve_task.done():
        for wid, why, fatal in children.exits():
            _worker_exit(wid, why, fatal, children.restart_note)
            router.mark_dead(wid, why)
            if fatal:
                rc, server.should_exit = 1, True
        if rc:
            break
        if not announced and server.started and all(w in router.workers and router.live(router.workers[w])
                                                     for w in children.ids()):
            _announce(options, sock, router.model, placement)
            announced = True
        if not announced and time.monotonic() > deadline:
            log.error("workers did not all say hello within %.0f s; stopping", options.startup_timeout)
            rc, server.should_exit = 1, True
            break
        await asyncio.sleep(0.2)
    await serve_task
    return rc


def run(options: ServeOptions) -> int:
    """Exit status: 0 clean stop; 1 HTTP port not bindable, a fatal worker exit or workers never up;
    2 a bad option or model, Ray not installed, or too little memory (:func:`check_capacity`)."""
    setup_logging(options.router.log_level)
    if options.on_ray:
        try:
            extras.need("ray", "epdserve serve --cluster ray")
        except extras.MissingExtra as exc:
            print(exc, file=sys.stderr)
            return 2
    options, plan, error = _check_options(options)
    if error:
        print(f"epdserve serve: error: {error}", file=sys.stderr)
        return 2
    host_name, port = options.router.host, options.router.port
    try:
        sock = listen_socket(host_name, port)
    except (OSError, OverflowError) as exc:
        busy = getattr(exc, "errno", None) == errno.EADDRINUSE
        print(f"epdserve serve: error: cannot listen on {host_name}:{port}: "
              f"{getattr(exc, 'strerror', None) or str(exc).rstrip('.')}; "
              f"{'stop what listens there or ' if busy else ''}pass another --port (0: any free port)",
              file=sys.stderr)
        return 1
    workers = Children(worker_env(options.router.auth))
    if options.on_ray:
        workers = ray_cluster.RayWorkers(options, worker_env(options.router.auth))
        try:
            workers.connect()
        except ConnectionError as exc:
            print(f"epdserve serve: error: {exc}", file=sys.stderr)
            sock.close()
            return 1
    tmp = tempfile.mkdtemp(prefix="epdserve-")  # mode 0700: only we can reach the sockets
    events = options.events or (ray_cluster.events_address() if options.on_ray else f"ipc://{tmp}/events")
    loaded, warnings, error = _load_router(options, plan, events)
    if error:
        print(f"epdserve serve: error: {error}", file=sys.stderr)
        sock.close()
        workers.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        return 2
    for text in warnings:
        print(f"epdserve serve: warning: {text}", file=sys.stderr, flush=True)
    return _serve(options, loaded, plan, tmp, events, sock, workers)


def _check_options(options: ServeOptions) -> tuple[ServeOptions, Placement, str | None]:
    """``(resolved options, placement, error or None)``; makes up an auth token when one is needed."""
    try:
        options = replace(options, router=replace(options.router, model=model_from_tag(options)))
        plan = checked_plan(options)
        options = replace(options, max_workers=_check_elastic(options, len(plan)))
        if options.on_ray:
            ray_cluster.role_resources(options)
    except ValueError as exc:
        return options, [], str(exc)
    security = options.router.auth
    if not security.auth_token and (not security.allow_unauthenticated or security.internal_encryption == "curve"):
        # on ipc too (defence in depth); CURVE derives its keys from it
        security = replace(security, auth_token=secrets.token_urlsafe(32))
        options = replace(options, router=replace(options.router, auth=security))
        if options.events:
            log.info("no --auth-token: generated one; workers started elsewhere cannot join (give your own)")
    return options, plan, auth.options_error(security, [])


def model_from_tag(options: ServeOptions) -> str | None:
    """Raises ValueError when MODEL and ``--model`` name different models."""
    tag, model = options.model_tag, options.router.model
    if tag is None:
        return model
    if model not in (None, tag):
        raise ValueError(f"MODEL {tag!r} and --model {model!r} name different models; give one")
    return tag


def _check_elastic(options: ServeOptions, starting: int) -> int:
    """``--max-workers`` (default: ``starting``, no scaling).

    Raises:
        ValueError: a per-role or scaling flag that does not fit ``--elastic``, the mode or the cluster.
    """
    roles = {role: options.role(role) for role in ROLE_DEVICES}
    per_role = [(role, what) for role in ("prefill", "decode") for what, value in
                (("dtype", roles[role].dtype), ("weight-format", roles[role].weight_format),
                 ("kv-cache-dtype", roles[role].kv_cache_dtype)) if value]
    elastic, max_workers = options.elastic, options.max_workers
    if per_role and options.router.mode == "colocated" and not elastic:
        role, what = per_role[0]
        raise ValueError(f"--{role}-{what} applies to pd and epd modes; colocated workers take --{what}")
    if elastic:
        tied = [f"--{role}-{what}" for role, r in roles.items()
                for what, value in (("dtype", r.dtype), ("device", r.device), ("kv-cache-dtype", r.kv_cache_dtype))
                if value is not None]
        if tied:
            raise ValueError(f"{', '.join(tied)}: an elastic worker changes role, so every worker takes "
                             "--dtype, --device and --kv-cache-dtype")
    if max_workers is None:
        return starting
    if not elastic:
        raise ValueError(f"--max-workers {max_workers}: workers are added and retired only with --elastic")
    if max_workers < starting:
        raise ValueError(f"--max-workers {max_workers}: below the {starting} starting workers (the minimum)")
    if max_workers > starting and not options.on_ray:
        raise ValueError(f"--max-workers {max_workers}: adding workers needs --cluster ray "
                         f"(this host's cores are all given to the {starting} starting workers)")
    return max_workers


def _load_router(options: ServeOptions, plan: Placement,
                 events: str) -> tuple[Router | RouterInputs | None, list[str], str | None]:
    """``(loaded, warnings, error)``: the model is resolved (and converted) once, before any worker
    starts. Ray: the router, run in this process; local: its checked inputs, of which the router
    process forked from this one makes it (:mod:`.router_process`)."""
    try:
        loaded = build_router(options.router, events) if options.on_ray else router_inputs(options.router)
    except ModelLoadError as exc:
        return None, [], str(exc)
    if options.on_ray:
        return loaded, [], None
    warnings, error = check_capacity(options, plan, loaded.model.path, host.mem_available_bytes())
    if error:
        error += "; use fewer workers or a smaller --kv-cache-memory-mb, or pass --allow-oversubscription"
    return loaded, warnings, error


class _Stop:
    """Set by SIGTERM or SIGINT: ``server`` (the router in this process) told to exit; before it runs,
    ``placing`` (Ray placing the workers) is interrupted."""

    def __init__(self, placing: bool):
        self.asked, self.server, self.placing = False, None, placing

    def __call__(self, signum, frame) -> None:
        self.asked = True
        if self.server is not None:
            self.server.should_exit = True
        elif self.placing:
            raise KeyboardInterrupt


def _serve(options: ServeOptions, loaded: Router | RouterInputs, plan: Placement, tmp: str, events: str,
           sock: socket.socket, children) -> int:
    router = loaded if isinstance(loaded, Router) else None
    stopped = False

    def cleanup() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            log.info("stopping the router and the workers")
            if router is None:
                children.stop(first=router_process.ROUTER_ID)  # its graceful end, then the workers'
            else:
                children.stop()
            log.info("all workers stopped")
            shutil.rmtree(tmp, ignore_errors=True)

    atexit.register(cleanup)
    # Our own handlers: uvicorn re-raises a captured SIGTERM after its shutdown, before the workers stop.
    stop = _Stop(placing=options.on_ray)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if options.on_ray:
        placement = children.placement(plan)
        commands = {wid: worker_flags(options, role, wid, events) for role, wid, _ in plan}
    else:
        placement = ", ".join(f"{wid} on cores {','.join(map(str, c))}" for _, wid, c in plan)
        commands = {wid: worker_command(options, role, wid, c, events, f"ipc://{tmp}/{wid}")
                    for role, wid, c in plan}
    log.info("placement: %s", placement)
    try:
        if router is None:
            return _serve_local(options, loaded, plan, events, sock, children, commands, placement, stop)
        try:
            children.launch(plan, commands)
        except TimeoutError as exc:
            print(f"epdserve serve: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            print("epdserve serve: stopped while Ray was placing the workers", file=sys.stderr, flush=True)
            return 1
        if options.elastic:
            children.command = lambda role, wid: worker_flags(options, role, wid, events)
            router.enable_scaling(children, len(plan), options.max_workers, options.startup_timeout)
        app = ray_cluster.before_router_stops(create_app(router), lambda: children.drain(router))
        config = uvicorn_config(app, options.router.host, options.router.port, options.router.http, lifespan="on",
                                timeout_graceful_shutdown=5)
        stop.server = uvicorn.Server(config)
        return asyncio.run(_supervise(stop.server, router, children, options, placement, sock))
    finally:
        cleanup()


def _serve_local(options: ServeOptions, inputs: RouterInputs, plan: Placement, events: str, sock: socket.socket,
                 children: Children, commands: dict[str, list[str]], placement: str, stop: _Stop) -> int:
    """The router in a process forked from this one, restarted when it dies (the workers keep
    running); a worker's exit is told to it. Returns 1 after a fatal worker exit (EXIT_CONFIG) or
    a startup timeout, 2 after the router's (a setting its ZeroMQ refused), 0 after a signal."""
    link, router_end = router_process.link_pair()
    setup = router_process.RouterSetup(options.router, inputs, events, sock, router_end,
                                       tuple(wid for _, wid, _ in plan), len(plan), options.max_workers,
                                       options.startup_timeout)
    children.fork(router_process.ROUTER_ID, lambda restarted: router_process.run(setup, restarted))
    children.launch(plan, commands)
    announced, deadline = 0, time.monotonic() + options.startup_timeout
    while not stop.asked:
        for wid, why, fatal in children.exits():
            if wid == router_process.ROUTER_ID:
                note = "stopping" if fatal else "restarting it; the workers keep running and join it again"
                log.error("the router: %s; %s", why, note)
                print(f"epdserve serve: the router: {why}; {note}", file=sys.stderr, flush=True)
                if fatal:
                    return 2
                continue
            _worker_exit(wid, why, fatal, children.restart_note)
            router_process.send(link, event="down", worker=wid, pid=children.pid(wid), why=why)
            if fatal:
                return 1
        for message in router_process.received(link):
            if message["event"] == "ready":
                _announce(options, sock, inputs.model, placement, again=announced > 0)
                announced += 1
        if not announced and time.monotonic() > deadline:
            log.error("workers did not all say hello within %.0f s; stopping", options.startup_timeout)
            return 1
        time.sleep(0.2)
    return 0
