"""``serve --cluster local``'s worker subprocesses; :class:`~.ray_cluster.RayWorkers` is the Ray counterpart."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable

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


class Forked:
    """A child forked from this process that runs ``target()`` and exits with its status (1 if it
    raises): the part of ``subprocess.Popen`` :class:`Children` uses. Like a started worker it dies
    with this process and has a process group of its own."""

    def __init__(self, target: Callable[[], int]):
        parent = os.getpid()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                _die_with_parent(parent)
                for signum in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, signal.SIG_DFL)
                code = target()
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # never this process's atexit handlers or its caller's stack

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Raises subprocess.TimeoutExpired."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def terminate(self) -> None:
        os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


class Children:
    """Restarts an exited child (a worker, or serve's router) after a backoff (:data:`RESTART_BACKOFF_S`),
    never after EXIT_CONFIG."""

    restart_note = "restarting it"

    def __init__(self, env: dict[str, str]):
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.starts: dict[str, tuple[Callable[[bool], subprocess.Popen | Forked], str]] = {}  # how, and what
        self.started: dict[str, float] = {}
        self.backoff: dict[str, float] = {}  # last restart delay (s); -1: given up
        self.due: dict[str, float] = {}

    def start(self, worker_id: str, argv: list[str]) -> None:
        parent = os.getpid()
        self._start(worker_id, lambda restart: subprocess.Popen(argv, env=self.env,
                                                                preexec_fn=lambda: _die_with_parent(parent)),
                    " ".join(argv[3:]))

    def fork(self, child_id: str, target: Callable[[bool], int]) -> None:
        """A child forked from this process running ``target(restarted)``."""
        self._start(child_id, lambda restart: Forked(lambda: target(restart)), "forked from serve")

    def _start(self, child_id: str, make: Callable[[bool], subprocess.Popen | Forked], what: str) -> None:
        restart = child_id in self.procs
        self.starts[child_id] = (make, what)
        self.procs[child_id] = make(restart)
        self.started[child_id] = time.monotonic()
        log.info("started %s (pid %d): %s", child_id, self.procs[child_id].pid, what)

    def launch(self, plan: Placement, commands: dict[str, list[str]]) -> None:
        for _, wid, _ in plan:
            self.start(wid, commands[wid])

    def ids(self) -> list[str]:
        return list(self.procs)

    def pid(self, worker_id: str) -> int:
        return self.procs[worker_id].pid

    def exits(self) -> list[tuple[str, str, bool]]:
        """``(child id, why, fatal)``: fatal for EXIT_CONFIG."""
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
                self._start(wid, *self.starts[wid])
        return exited

    def drain(self, router) -> None:
        """Nothing: :meth:`stop`'s SIGTERM lets the workers free their shared memory."""

    def stop(self, grace_s: float = 10.0, first: str | None = None) -> None:
        """SIGTERM to every child, to ``first`` (serve's router) alone before the others, each then
        given ``grace_s`` to exit before SIGKILL."""
        self._stop([w for w in self.procs if w == first], grace_s)
        self._stop([w for w in self.procs if w != first], grace_s)

    def _stop(self, ids: list[str], grace_s: float) -> None:
        procs = [(w, self.procs[w]) for w in ids]
        for _, p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace_s
        for wid, p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM; killing it", wid, p.pid)
                p.kill()
                p.wait()
