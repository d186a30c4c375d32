"""``epdserve serve``: start a router and its workers on this host, and stop them together.

* colocated: one colocated worker on every core this process may use;
* pd: a prefill worker on the first half of the cores and a decode worker on the rest
  (on a one-core machine both share it).

Workers are ``python -m epdserve worker ...`` subprocesses talking to the router over
ZeroMQ ipc sockets in a private temporary directory. The router (uvicorn) runs in this
process; the URL is printed (``epdserve serve: ready at http://HOST:PORT``) once every
worker has said hello. Every worker is stopped when the launcher exits (normal exit,
SIGTERM/SIGINT, atexit) and is killed by the kernel if the launcher dies abruptly
(``PR_SET_PDEATHSIG``); if a worker dies, the launcher logs it and shuts the whole
deployment down with exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from epdserve.serving.router import Router, add_router_options, build_router, create_app, setup_logging

log = logging.getLogger("epdserve.launcher")

PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_options(parser)
    parser.add_argument("--cores", default=None,
                        help="comma-separated CPU cores to split among workers (default: all usable)")
    parser.add_argument("--kv-cache-memory-mb", type=int, default=None, help="passed to each worker")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="passed to each worker")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="passed to each worker")
    parser.add_argument("--block-size", type=int, default=None, help="passed to each worker")
    parser.add_argument("--dtype", default=None, help="passed to each worker")
    parser.add_argument("--enable-chunked-prefill", action="store_true", help="passed to each worker")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds to wait for every worker's hello")


def plan_workers(mode: str, cores: list[int]) -> list[tuple[str, str, list[int]]]:
    """``(role, worker_id, cores)`` for each worker of ``mode``.

    Raises:
        ValueError: no cores, or an unknown mode.
    """
    if not cores:
        raise ValueError("no CPU cores to place workers on")
    if mode == "colocated":
        return [("colocated", "colocated-0", cores)]
    if mode == "pd":
        half = max(1, len(cores) // 2)
        return [("prefill", "prefill-0", cores[:half]), ("decode", "decode-0", cores[half:] or cores)]
    raise ValueError(f"unknown mode {mode!r}")


def _die_with_parent(parent_pid: int) -> None:
    """In the child, before exec: get SIGKILL when the launcher dies, even by kill -9, and
    leave the launcher's process group so that Ctrl-C reaches only the launcher."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: rely on the launcher's own cleanup
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    os.setpgid(0, 0)


def worker_command(args: argparse.Namespace, role: str, worker_id: str, cores: list[int],
                   events: str, cmd: str) -> list[str]:
    argv = [sys.executable, "-m", "epdserve", "worker", "--role", role, "--router", events,
            "--bind", cmd, "--worker-id", worker_id, "--cores", ",".join(map(str, cores))]
    for opt in ("model", "kv_cache_memory_mb", "max_num_seqs", "max_num_batched_tokens", "block_size", "dtype"):
        value = getattr(args, opt)
        if value is not None:
            argv += ["--" + opt.replace("_", "-"), str(value)]
    if args.enable_chunked_prefill:
        argv.append("--enable-chunked-prefill")
    return argv


class Children:
    """The worker subprocesses; :meth:`stop` (idempotent) terminates them, then kills
    whatever is still alive after ``grace_s`` seconds."""

    def __init__(self):
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker_id: str, argv: list[str]) -> None:
        parent = os.getpid()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[worker_id] = subprocess.Popen(argv, env=env, preexec_fn=lambda: _die_with_parent(parent))
        log.info("started worker %s (pid %d): %s", worker_id, self.procs[worker_id].pid, " ".join(argv[3:]))

    def exited(self) -> list[tuple[str, subprocess.Popen]]:
        return [(wid, p) for wid, p in self.procs.items() if p.poll() is not None]

    def stop(self, grace_s: float = 10.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for wid, p in self.procs.items():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %s (pid %d) ignored SIGTERM; killing it", wid, p.pid)
                p.kill()
                p.wait()


async def _supervise(server, router: Router, children: Children, args, placement: str) -> int:
    """Run uvicorn, announce the URL once every worker said hello, and stop everything
    when a worker dies (returns 1) or a signal arrives (returns 0)."""
    serve_task = asyncio.create_task(server.serve())
    rc = 0
    announced = False
    deadline = time.monotonic() + args.startup_timeout
    while not serve_task.done():
        for wid, proc in children.exited():
            msg = f"epdserve serve: worker {wid} (pid {proc.pid}) exited with code {proc.returncode}; stopping"
            log.error(msg)
            print(msg, file=sys.stderr, flush=True)
            router.mark_dead(wid, f"process exited with code {proc.returncode}")
            rc, server.should_exit = 1, True
        if rc:
            break
        if not announced and server.started and all(w in router.workers for w in children.procs):
            port = server.servers[0].sockets[0].getsockname()[1]
            print(f"epdserve serve: ready at http://{args.host}:{port} (mode {args.mode}, model "
                  f"{router.model.name}; {placement})", flush=True)
            announced = True
        if not announced and time.monotonic() > deadline:
            log.error("workers did not all say hello within %.0f s; stopping", args.startup_timeout)
            rc, server.should_exit = 1, True
            break
        await asyncio.sleep(0.2)
    await serve_task
    return rc


def run(args: argparse.Namespace) -> int:
    """``epdserve serve``: returns 0 after a clean stop, 1 if a worker died or never came up."""
    import uvicorn

    from epdserve.model.loader import ModelLoadError

    setup_logging(args.log_level)
    cores = ([int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0)))
    plan = plan_workers(args.mode, cores)
    tmp = tempfile.mkdtemp(prefix="epdserve-")  # mode 0700: only we can reach the sockets
    events = f"ipc://{tmp}/events"
    try:
        router = build_router(args, events)  # resolves (and converts) the model once, before workers start
    except ModelLoadError as exc:
        print(f"epdserve serve: error: {exc}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
        return 2
    children = Children()
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
    # Handlers of our own, so that uvicorn re-raising a captured SIGTERM after its graceful
    # shutdown does not kill us before the workers are stopped.
    server = None

    def on_signal(signum, frame):
        if server is not None:
            server.should_exit = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for role, wid, wcores in plan:
            children.start(wid, worker_command(args, role, wid, wcores, events, f"ipc://{tmp}/{wid}"))
        config = uvicorn.Config(create_app(router), host=args.host, port=args.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        placement = ", ".join(f"{wid} on cores {','.join(map(str, c))}" for _, wid, c in plan)
        return asyncio.run(_supervise(server, router, children, args, placement))
    finally:
        cleanup()
