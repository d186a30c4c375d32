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

import uvicorn

from epdserve import extras, host
from epdserve.argtypes import Options, config_from, float_above, int_at_least, with_values
from epdserve.model.kv_cache_dtype import KV_CACHE_DTYPES
from epdserve.model.loader import ModelLoadError
from epdserve.model.linear import WEIGHT_FORMATS, auto_format
from epdserve.engine.config import DEVICE_METAVAR, DTYPE_CHOICES, device_type
from epdserve.serving import auth, flags
from epdserve.serving.launch import ray_cluster
from epdserve.serving.launch.children import Children
from epdserve.serving.deployment import Placement, serve_tp_sizes
from epdserve.serving.launch.placement import checked_plan, plan_for, usable_cores  # noqa: F401 (serve's API)
from epdserve.serving.router.http_guard import HttpLimits, uvicorn_config
from epdserve.serving.router.options import RouterOptions
from epdserve.serving.worker.setup import WORKER_FLAGS, worker_argv, worker_default
from epdserve.serving.router import (SYNTHETIC_VISION_NOTE, Router, add_router_options, build_router, create_app,
                                     setup_logging)

log = logging.getLogger("epdserve.launcher")

ROLE_DEVICES = ("prefill", "decode", "encode")  # the roles with a --ROLE-device of their own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Worker flags are declared once (:mod:`epdserve.serving.flags`), so a bad value stops
    serve (exit 2), not every worker; unset, a worker keeps its own default."""
    add_router_options(parser)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as in `vllm serve MODEL`: the same as --model")
    flags.CORES_FLAG.add(parser)
    for flag in WORKER_FLAGS:
        flag.add(parser, passed=True)
    for flag in flags.ROLE_TP_FLAGS:
        flag.add(parser)
    parser.add_argument("--prefill-dtype", choices=DTYPE_CHOICES, default=None,
                        help="pd: weights and KV cache dtype of the prefill workers (default: --dtype)")
    parser.add_argument("--decode-dtype", choices=DTYPE_CHOICES, default=None,
                        help="pd: weights and KV cache dtype of the decode workers, which convert "
                             "imported KV to it (default: --dtype)")
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-weight-format", choices=WEIGHT_FORMATS, default=None,
                            help=f"pd: the weight format of the {role} workers (default: --weight-format; "
                                 f"its auto already gives them {auto_format(role == 'prefill', role == 'decode')})")
        parser.add_argument(f"--{role}-kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                            help=f"pd: the KV cache dtype of the {role} workers (default: --kv-cache-dtype; a "
                                 "hand-off converts between the two)")
    for role in ROLE_DEVICES:
        parser.add_argument(f"--{role}-device", type=device_type, default=None, metavar=DEVICE_METAVAR,
                            help=f"pd, epd: the device of the {role} workers (default: --device; docs/gpu.md)")
    parser.add_argument("--startup-timeout", type=float_above(0), default=900.0,
                        help="seconds to wait for every worker's hello")
    parser.add_argument("--workers", "--data-parallel-size", "-dp", type=int_at_least(1), default=1,
                        help="colocated: number of worker replicas (vLLM's --data-parallel-size)")
    parser.add_argument("--prefill-workers", type=int_at_least(1), default=1, help="pd, epd: number of prefill workers")
    parser.add_argument("--decode-workers", type=int_at_least(1), default=1, help="pd, epd: number of decode workers")
    parser.add_argument("--encode-workers", type=int_at_least(1), default=1, help="epd: number of encode workers")
    parser.add_argument("--max-workers", type=int_at_least(1), default=None, metavar="N",
                        help="--elastic: at most this many engine workers; the starting ones are the minimum and "
                             "the controller (or POST /workers, DELETE /workers/ID) adds and retires workers in "
                             "between (default: the starting count, no scaling; above it needs --cluster ray; "
                             "docs/elastic.md)")
    flags.ALLOW_OVERSUBSCRIPTION_FLAG.add(parser)
    flags.EVENTS_FLAG.add(parser)
    ray_cluster.add_arguments(parser)


def check_capacity(args: Options, plan: Placement, model_dir: str,
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
    kv_mb = args.kv_cache_memory_mb or worker_default("kv_cache_memory_mb")
    weights = host.weight_bytes(model_dir)
    ranks = serve_tp_sizes(args)
    host_kv = [(role != "encode" and (role_device(args, role) or "cpu") == "cpu") * ranks[role] for role, _, _ in plan]
    need = sum(weights + kv_mb * 2**20 * kv for kv in host_kv)
    if need <= available_bytes:
        return warnings, None
    exempt = "; encode and GPU workers: no KV cache in host memory" if not all(host_kv) else ""
    per = "worker rank" if max(ranks.values()) > 1 else "worker"
    fact = (f"{len(plan)} workers need about {need / 2**30:.1f} GiB ({weights / 2**30:.2f} GiB of weights + "
            f"{kv_mb} MiB of KV cache per {per}{exempt}) but {available_bytes / 2**30:.1f} GiB is available "
            f"(MemAvailable)")
    if args.allow_oversubscription:
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


def role_device(args: Options, role: str) -> str | None:
    """``--ROLE-device``, else ``--device``; None: neither given (the worker's default, the CPU)."""
    return (getattr(args, f"{role}_device", None) if role in ROLE_DEVICES else None) or args.device


def worker_flags(args: Options, role: str, worker_id: str, events: str) -> list[str]:
    """serve's per-role flags (``--prefill-dtype``, ``--decode-device``, ``--prefill-tp``, ...) as
    the worker's own (``--dtype``, ``--device``, ``--tensor-parallel-size``)."""
    def own(name: str):
        return (getattr(args, f"{role}_{name}", None) if role in ("prefill", "decode") else None) or getattr(args, name)

    ranks = serve_tp_sizes(args)[role]
    return ["--role", role, "--router", events, "--worker-id", worker_id, *(["--elastic"] if args.elastic else []),
            *worker_argv(dict(vars(args), dtype=own("dtype"), weight_format=own("weight_format"),
                              kv_cache_dtype=own("kv_cache_dtype"), device=role_device(args, role),
                              tensor_parallel_size=ranks if ranks > 1 else None))]


def worker_command(args: Options, role: str, worker_id: str, cores: list[int],
                   events: str, cmd: str) -> list[str]:
    return [sys.executable, "-m", "epdserve", "worker", *worker_flags(args, role, worker_id, events),
            "--bind", cmd, "--cores", ",".join(map(str, cores))]


def worker_env(args: Options) -> dict[str, str]:
    """The security options by environment: argv is readable by any local user."""
    env = {"EPDSERVE_INTERNAL_ENCRYPTION": args.internal_encryption,
           "EPDSERVE_ALLOW_UNAUTHENTICATED": "1" if args.allow_unauthenticated else "0"}
    if args.auth_token:
        env["EPDSERVE_AUTH_TOKEN"] = args.auth_token
    return env


async def _supervise(server, router: Router, children, args, placement: str, sock: socket.socket) -> int:
    """Returns 1 after a fatal worker exit (EXIT_CONFIG) or a startup timeout, 0 after a signal."""
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    rc = 0
    announced = False
    deadline = time.monotonic() + args.startup_timeout
    while not serve_task.done():
        for wid, why, fatal in children.exits():
            msg = (f"epdserve serve: worker {wid}: {why}; "
                   + ("stopping (its configuration is wrong)" if fatal else children.restart_note))
            log.error(msg)
            print(msg, file=sys.stderr, flush=True)
            router.mark_dead(wid, why)
            if fatal:
                rc, server.should_exit = 1, True
        if rc:
            break
        if not announced and server.started and all(w in router.workers and router.live(router.workers[w])
                                                     for w in children.ids()):
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"epdserve serve: ready at http://{args.host}:{port} (mode {args.mode}, model "
                  f"{router.model.name}; {placement})", flush=True)
            if router.model.synthetic_vision:
                print(f"epdserve serve: note: {SYNTHETIC_VISION_NOTE}", flush=True)
            announced = True
        if not announced and time.monotonic() > deadline:
            log.error("workers did not all say hello within %.0f s; stopping", args.startup_timeout)
            rc, server.should_exit = 1, True
            break
        await asyncio.sleep(0.2)
    await serve_task
    return rc


def run(args: Options) -> int:
    """Exit status: 0 clean stop; 1 HTTP port not bindable, a fatal worker exit or workers never up;
    2 a bad option or model, Ray not installed, or too little memory (:func:`check_capacity`)."""
    setup_logging(args.log_level)
    if args.cluster == "ray":
        try:
            extras.need("ray", "epdserve serve --cluster ray")
        except extras.MissingExtra as exc:
            print(exc, file=sys.stderr)
            return 2
    args, plan, error = _check_options(args)
    if error:
        print(f"epdserve serve: error: {error}", file=sys.stderr)
        return 2
    try:
        sock = listen_socket(args.host, args.port)
    except (OSError, OverflowError) as exc:
        busy = getattr(exc, "errno", None) == errno.EADDRINUSE
        print(f"epdserve serve: error: cannot listen on {args.host}:{args.port}: "
              f"{getattr(exc, 'strerror', None) or str(exc).rstrip('.')}; "
              f"{'stop what listens there or ' if busy else ''}pass another --port (0: any free port)",
              file=sys.stderr)
        return 1
    workers = Children(worker_env(args))
    if args.cluster == "ray":
        workers = ray_cluster.RayWorkers(args, worker_env(args))
        try:
            workers.connect()
        except ConnectionError as exc:
            print(f"epdserve serve: error: {exc}", file=sys.stderr)
            sock.close()
            return 1
    tmp = tempfile.mkdtemp(prefix="epdserve-")  # mode 0700: only we can reach the sockets
    events = args.events or (ray_cluster.events_address() if args.cluster == "ray" else f"ipc://{tmp}/events")
    router, warnings, error = _load_router(args, plan, events)
    if error:
        print(f"epdserve serve: error: {error}", file=sys.stderr)
        sock.close()
        workers.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        return 2
    for text in warnings:
        print(f"epdserve serve: warning: {text}", file=sys.stderr, flush=True)
    return _serve(args, router, plan, tmp, events, sock, workers)


def _check_options(args: Options) -> tuple[Options, Placement, str | None]:
    """``(resolved args, placement, error or None)``; makes up an auth token when one is needed."""
    try:
        args = with_values(args, model=model_from_tag(args))
        plan = checked_plan(args)
        args = with_values(args, max_workers=_check_elastic(args, len(plan)))
        if args.cluster == "ray":
            ray_cluster.role_resources(args)
    except ValueError as exc:
        return args, [], str(exc)
    if not args.auth_token and (not args.allow_unauthenticated or args.internal_encryption == "curve"):
        # on ipc too (defence in depth); CURVE derives its keys from it
        args = with_values(args, auth_token=secrets.token_urlsafe(32))
        if args.events:
            log.info("no --auth-token: generated one; workers started elsewhere cannot join (give your own)")
    return args, plan, auth.options_error(config_from(auth.AuthOptions, args), [])


def model_from_tag(args: Options) -> str | None:
    """Raises ValueError when MODEL and ``--model`` name different models."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return args.model
    if args.model not in (None, tag):
        raise ValueError(f"MODEL {tag!r} and --model {args.model!r} name different models; give one")
    return tag


def _check_elastic(args: Options, starting: int) -> int:
    """``--max-workers`` (default: ``starting``, no scaling).

    Raises:
        ValueError: a per-role or scaling flag that does not fit ``--elastic``, the mode or the cluster.
    """
    per_role = [(role, what.replace("_", "-")) for role in ("prefill", "decode")
                for what in ("dtype", "weight_format", "kv_cache_dtype") if getattr(args, f"{role}_{what}", None)]
    if per_role and args.mode == "colocated" and not args.elastic:
        role, what = per_role[0]
        raise ValueError(f"--{role}-{what} applies to pd and epd modes; colocated workers take --{what}")
    if args.elastic:
        tied = [f"--{role}-{what}" for role in ROLE_DEVICES for what in ("dtype", "device", "kv-cache-dtype")
                if getattr(args, f"{role}_{what.replace('-', '_')}", None) is not None]
        if tied:
            raise ValueError(f"{', '.join(tied)}: an elastic worker changes role, so every worker takes "
                             "--dtype, --device and --kv-cache-dtype")
    if args.max_workers is None:
        return starting
    if not args.elastic:
        raise ValueError(f"--max-workers {args.max_workers}: workers are added and retired only with --elastic")
    if args.max_workers < starting:
        raise ValueError(f"--max-workers {args.max_workers}: below the {starting} starting workers (the minimum)")
    if args.max_workers > starting and args.cluster != "ray":
        raise ValueError(f"--max-workers {args.max_workers}: adding workers needs --cluster ray "
                         f"(this host's cores are all given to the {starting} starting workers)")
    return args.max_workers


def _load_router(args: Options, plan: Placement, events: str) -> tuple[Router | None, list[str], str | None]:
    """``(router, warnings, error)``: the model is resolved (and converted) once, before any worker starts."""
    try:
        router = build_router(config_from(RouterOptions, args), events)
    except ModelLoadError as exc:
        return None, [], str(exc)
    if args.cluster == "ray":
        return router, [], None
    warnings, error = check_capacity(args, plan, router.model.path, host.mem_available_bytes())
    if error:
        error += "; use fewer workers or a smaller --kv-cache-memory-mb, or pass --allow-oversubscription"
    return router, warnings, error


def _serve(args: Options, router: Router, plan: Placement, tmp: str, events: str,
           sock: socket.socket, children) -> int:
    stopped = False

    def cleanup() -> None:
        nonlocal stopped
        if not stopped:
            stopped = True
            log.info("stopping workers")
            children.stop()
            log.info("all workers stopped")
            shutil.rmtree(tmp, ignore_errors=True)

    atexit.register(cleanup)
    # Our own handlers: uvicorn re-raises a captured SIGTERM after its shutdown, before the workers stop.
    server = None

    def on_signal(signum, frame):
        if server is not None:
            server.should_exit = True
        elif args.cluster == "ray":  # still placing the workers
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.cluster == "ray":
        placement = children.placement(plan)
        commands = {wid: worker_flags(args, role, wid, events) for role, wid, _ in plan}
    else:
        placement = ", ".join(f"{wid} on cores {','.join(map(str, c))}" for _, wid, c in plan)
        commands = {wid: worker_command(args, role, wid, c, events, f"ipc://{tmp}/{wid}") for role, wid, c in plan}
    log.info("placement: %s", placement)
    try:
        try:
            children.launch(plan, commands)
        except TimeoutError as exc:
            print(f"epdserve serve: error: {exc}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            print("epdserve serve: stopped while Ray was placing the workers", file=sys.stderr, flush=True)
            return 1
        if args.elastic:
            scaler = children if args.cluster == "ray" else None
            if scaler is not None:
                scaler.command = lambda role, wid: worker_flags(args, role, wid, events)
            router.enable_scaling(scaler, len(plan), args.max_workers, args.startup_timeout)
        app = ray_cluster.before_router_stops(create_app(router), lambda: children.drain(router))
        config = uvicorn_config(app, args.host, args.port, config_from(HttpLimits, args), lifespan="on",
                                timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        return asyncio.run(_supervise(server, router, children, args, placement, sock))
    finally:
        cleanup()

