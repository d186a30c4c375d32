"""``serve --cluster local``'s worker subprocesses; :class:`~.ray_cluster.RayWorkers` is the Ray counterpart."""

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
    """Before exec: SIGKILL on the launcher's death (``PR_SET_PDEATHSIG``); own process group, so Ctrl-C skips it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    os.setpgid(0, 0)


class Children:
    """Restarts an exited worker after a backoff (:data:`RESTART_BACKOFF_S`), never after EXIT_CONFIG."""

    restart_note = "restarting it"

    def __init__(self, env: dict[str, str]):
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.started: dict[str, float] = {}
        self.backoff: dict[str, float] = {}  # last restart delay (s); -1: given up
        self.due: dict[str, float] = {}

    def start(self, worker_id: str, argv: list[str]) -> None:
        parent = os.getpid()
        self.argv[worker_id] = argv
        self.procs[worker_id] = subprocess.Popen(argv, env=self.env, preexec_fn=lambda: _die_with_parent(parent))
        self.started[worker_id] = time.monotonic()
        log.info("started worker %s (pid %d): %s", worker_id, self.procs[worker_id].pid, " ".join(argv[3:]))

    def launch(self, plan: Placement, commands: dict[str, list[str]]) -> None:
        for _, wid, _ in plan:
            self.start(wid, commands[wid])

    def ids(self) -> list[str]:
        return list(self.procs)

    def exits(self) -> list[tuple[str, str, bool]]:
        """``(worker id, why, fatal)``: fatal for EXIT_CONFIG."""
        return [(wid, f"process exited with code {p.returncode}", p.returncode == EXIT_CONFIG)
                for wid, p in self.watch()]

    def watch(self) -> list[tuple[str, subprocess.Popen]]:
        """Workers that exited since the last call; restarts those whose backoff is over."""
        now, exited = time.monotonic(), []
        for wid, p in self.procs.items():
            if wid in self.due or p.poll() is None or wid in self.backoff and self.backoff[wid] < 0:
                continue
            exited.append((wid, p))
            if p.returncode == EXIT_CONFIG:
                self.backoff[wid] = -1.0
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
        """Nothing: :meth:`stop`'s SIGTERM lets the workers free their shared memory."""

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
