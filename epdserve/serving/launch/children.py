"""The local launcher's worker subprocesses (``epdserve serve --cluster local``): started
with the environment the launcher gives them, killed by the kernel if the launcher dies
(``PR_SET_PDEATHSIG``), restarted after a backoff when they exit (1 s, doubled while a
worker keeps dying within a minute, at most 30 s; not after EXIT_CONFIG), and stopped
together. :class:`Children` is what :mod:`epdserve.serving.launch.launcher` drives; on Ray,
:class:`~epdserve.serving.launch.ray_cluster.RayWorkers` plays its part."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time

from epdserve.serving.deployment import Placement

log = logging.getLogger("epdserve.launcher")

PR_SET_PDEATHSIG = 1
EXIT_CONFIG = 2  # a worker's exit status for a bad option or model, or a refusal: no restart
RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, cap; doubled while a worker dies within a minute


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


class Children:
    """The worker subprocesses. :meth:`watch` reports the ones that exited and restarts
    them after a backoff; :meth:`stop` (idempotent) terminates them, then kills whatever is
    still alive after ``grace_s`` seconds. ``env`` is added to each worker's environment.
    :meth:`launch`, :meth:`ids`, :meth:`exits` and :meth:`stop` are what ``serve`` uses,
    as of :class:`~epdserve.serving.launch.ray_cluster.RayWorkers`."""

    restart_note = "restarting it"

    def __init__(self, env: dict[str, str]):
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.started: dict[str, float] = {}  # worker id -> time.monotonic() of its start
        self.backoff: dict[str, float] = {}  # worker id -> its last restart delay (s)
        self.due: dict[str, float] = {}      # worker id -> when to restart it

    def start(self, worker_id: str, argv: list[str]) -> None:
        parent = os.getpid()
        self.argv[worker_id] = argv
        self.procs[worker_id] = subprocess.Popen(argv, env=self.env, preexec_fn=lambda: _die_with_parent(parent))
        self.started[worker_id] = time.monotonic()
        log.info("started worker %s (pid %d): %s", worker_id, self.procs[worker_id].pid, " ".join(argv[3:]))

    def launch(self, plan: Placement, commands: dict[str, list[str]]) -> None:
        """Start each worker of ``plan`` with its command line ``commands[worker id]``."""
        for _, wid, _ in plan:
            self.start(wid, commands[wid])

    def ids(self) -> list[str]:
        """The worker ids started."""
        return list(self.procs)

    def exits(self) -> list[tuple[str, str, bool]]:
        """:meth:`watch` as ``(worker id, why, fatal)``: fatal for EXIT_CONFIG."""
        return [(wid, f"process exited with code {p.returncode}", p.returncode == EXIT_CONFIG)
                for wid, p in self.watch()]

    def watch(self) -> list[tuple[str, subprocess.Popen]]:
        """Workers that exited since the last call; restart those whose backoff is over.
        A worker that exited with EXIT_CONFIG is reported and not restarted."""
        now, exited = time.monotonic(), []
        for wid, p in self.procs.items():
            if wid in self.due or p.poll() is None or wid in self.backoff and self.backoff[wid] < 0:
                continue
            exited.append((wid, p))
            if p.returncode == EXIT_CONFIG:
                self.backoff[wid] = -1.0  # given up
                continue
            first, cap = RESTART_BACKOFF_S
            quick = now - self.started[wid] < 60.0
            self.backoff[wid] = min(cap, 2 * self.backoff[wid]) if quick and wid in self.backoff else first
            self.due[wid] = now + self.backoff[wid]
        for wid, when in list(self.due.items()):
            if now >= when:
                del self.due[wid]
                self.start(wid, self.argv[wid])
        return exited

    def drain(self, router) -> None:
        """Nothing before the router stops: :meth:`stop` SIGTERMs the workers, which free
        their shared memory on the way out."""

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
