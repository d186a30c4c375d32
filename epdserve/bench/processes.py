"""Server processes compare starts, waits for and stops, each in its own process group
(``start_new_session``) and log file: stopping reaches every child it started, and a Ctrl-C
at the terminal reaches only compare, which then stops them in order."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

import httpx

from epdserve.bench import client, metrics
from epdserve.bench.deployments import Deployment, ModelVariables, Resources, file_stem
from epdserve.serving.deployment import ELASTIC_SLO_KEYS, DeploymentSpec

POLL_S = 0.5
WATCH_S = 0.2
BASE_URL_WAIT_S = 30.0  # a base_url without a ready check must answer within this
SERVE = [sys.executable, "-m", "epdserve", "serve"]


class ServerError(RuntimeError):
    """A server that did not start, get ready, or stay up; ``str()`` is ``reason`` then
    ``log_tail`` (its log's last lines, '' when none)."""

    def __init__(self, reason: str, log_tail: str = ""):
        self.reason, self.log_tail = reason, log_tail
        super().__init__(reason + (f"; last lines of its log:\n{log_tail}" if log_tail else ""))


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def logs_tail(paths: list[Path], lines: int = 20) -> str:
    """One log's tail; of several, each under a ``--- NAME ---`` line, empty ones left out."""
    if len(paths) == 1:
        return log_tail(paths[0], lines)
    tails = [(p, log_tail(p, lines)) for p in paths]
    return "\n".join(f"--- {p.name} ---\n{t}" for p, t in tails if t)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class ServerProcess:
    """One server process in its own process group, stdout and stderr in ``log_path``
    (truncated at start); ``base_url`` '' when it has none of its own."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, base_url: str = "",
                 env: dict[str, str] | None = None, cwd: str | None = None):
        self.name, self.cmd, self.log_path, self.base_url = name, cmd, log_path, base_url
        self.env, self.cwd = env or {}, cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Raises ServerError when the program cannot be run."""
        env = {**os.environ, **self.env} if self.env else None
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             env=env, cwd=self.cwd)
            except OSError as exc:  # FileNotFoundError, PermissionError, NotADirectoryError
                raise ServerError(f"{self.name}: cannot run {self.cmd[0]!r}: "
                                  f"{exc.strerror or exc}") from None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def wait_healthy(self, timeout_s: float, workers: int = 1) -> float:
        """Seconds until ``/health`` answers 200 with ``workers`` up: the router
        answers 200 once one worker per role is up, too early for a run. Raises ServerError."""
        return wait_ready(self.base_url + "/health", [self], timeout_s, workers=workers)

    def resources(self) -> dict:
        """``workers`` (id, role, pinned cores, weight format, KV dtype, tuned choices), ``cores`` and
        ``num_cores`` from ``/health``; ``num_cores`` None when no worker lists cores."""
        try:
            with httpx.Client(timeout=5.0, trust_env=False) as http:
                body = http.get(self.base_url + "/health").json()
        except (httpx.HTTPError, ValueError):
            body = {}
        if not isinstance(body, dict):
            body = {}
        workers = [{k: w.get(k) for k in ("worker_id", "role", "cores", "weight_format", "kv_dtype", "tuned")}
                   for w in body.get("workers", []) if isinstance(w, dict)]
        cores = sorted({c for w in workers for c in (w["cores"] or [])})
        return {"workers": workers, "cores": cores, "num_cores": len(cores) or None}

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, wait up to ``grace_s``, then SIGKILL what is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        _killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + (grace_s if self.proc.returncode is not None else 0)
        while group_alive(pgid) and time.monotonic() < deadline:  # children still exiting
            time.sleep(0.2)
        if group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None


def wait_ready(url: str, processes: list[ServerProcess], timeout_s: float,
               status: int | None = 200, workers: int = 0) -> float:
    """Seconds until ``url`` answers ``status`` (None: any answer) with ``workers`` "up" in
    its JSON body (a body without a worker list passes), polled every :data:`POLL_S`.

    Raises ServerError when a process exits (its status and log tail) or ``timeout_s`` passes."""
    start = time.monotonic()
    with httpx.Client(timeout=2.0, trust_env=False) as http:
        while True:
            for p in processes:
                rc = p.poll()
                if rc is not None:
                    raise ServerError(f"{p.name} exited with status {rc} before {url} "
                                      f"answered", log_tail(p.log_path))
            try:
                answer = http.get(url)
                if status in (None, answer.status_code) and (
                        not workers or _workers_up(answer.json()) >= workers):
                    return time.monotonic() - start
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() - start > timeout_s:
                what = f" {status}" if status else ""
                up = f" with {workers} workers up" if workers else ""
                raise ServerError(f"{url} did not answer{what}{up} within {timeout_s:g} s",
                                  logs_tail([p.log_path for p in processes]))
            time.sleep(POLL_S)


def _workers_up(health: dict) -> float:
    """Infinite for a body without a worker list (not epdserve's: 200 is all it says)."""
    if not isinstance(health, dict) or not isinstance(health.get("workers"), list):
        return float("inf")
    return sum(1 for w in health["workers"] if isinstance(w, dict) and w.get("state") == "up")


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def server_command(name: str, port: int, trace_file: Path, model: str | None,
                   serve: list[str] = SERVE, allow_oversubscription: bool = False,
                   slos_ms: dict[str, float] | None = None) -> list[str]:
    """``serve`` (or a stand-in taking its options) for one configuration. An elastic one
    gets ``--slo`` with the TTFT and TPOT of ``slos_ms``, else of DEFAULT_SLOS_MS: its controller
    steers for the SLOs compare judges it by."""
    spec = DeploymentSpec.parse(name)
    cmd = [*serve, *spec.serve_flags()]
    if spec.elastic:
        steered = [f"{k}:{v:g}" for k, v in (slos_ms or metrics.DEFAULT_SLOS_MS).items() if k in ELASTIC_SLO_KEYS]
        cmd += ["--slo", *steered] if steered else []  # none of them given: serve's defaults
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--trace-file", str(trace_file)]
    if model:
        cmd += ["--model", model]
    if allow_oversubscription:
        cmd.append("--allow-oversubscription")
    return cmd


@dataclass
class LaunchOptions:
    """``slos_ms``: compare's ``--goodput`` (ms), which an elastic deployment steers for."""

    port: int = 8100
    model: str | None = None
    startup_timeout_s: float = 300.0
    allow_oversubscription: bool = False
    serve: list[str] = field(default_factory=lambda: list(SERVE))
    slos_ms: dict[str, float] | None = None


class Running:
    """A deployment being started, run, then stopped (use :func:`launched`). ``died`` is set
    once one of its processes exits mid-run; the others are then stopped at once, so requests in
    flight fail now rather than at their timeouts."""

    def __init__(self, dep: Deployment, out_dir: Path, opts: LaunchOptions,
                 say: Callable[[str], None] = print):
        self.dep, self.opts, self.say = dep, opts, say
        self.model: str | None = dep.model if dep.kind != "epdserve" else None
        self.died: dict | None = None
        self._lock, self._stopping = threading.Lock(), threading.Event()
        self._watchdog: threading.Thread | None = None
        if dep.epdserve:
            self.client_url = f"http://127.0.0.1:{opts.port}"
            self.trace_file: Path | None = (out_dir / f"{file_stem(dep.name)}.server.jsonl").resolve()
            cmd = server_command(dep.epdserve, opts.port, self.trace_file,
                                 dep.model or opts.model, opts.serve,
                                 opts.allow_oversubscription, opts.slos_ms) + (dep.args or [])
            self.processes = [ServerProcess(dep.name, cmd, out_dir / f"{file_stem(dep.name)}.server.log",
                                            self.client_url)]
            self.metrics_urls = dep.metrics_urls or [self.client_url + "/metrics"]
            return
        self.client_url = (dep.openai_base_url or dep.base_url).removesuffix("/v1")
        self.trace_file = None
        self.processes = [ServerProcess(f"{dep.name}.p{i}", p.command,
                                        out_dir / f"{file_stem(dep.name)}.p{i}.log", env=p.env, cwd=p.cwd)
                          for i, p in enumerate(dep.resolved_processes(ModelVariables(opts.model)))]
        self.metrics_urls = list(dep.metrics_urls or [])

    @property
    def root_pids(self) -> list[int]:
        return [p.proc.pid for p in self.processes if p.proc is not None]

    def start(self) -> None:
        """Start the processes in order, wait until ready, check it is an OpenAI server.

        Raises ServerError: a port taken, a process that cannot run or exits, a ready check timing
        out, or a URL that is not an OpenAI server."""
        self._check_ports()
        if self.dep.epdserve:
            server = self.processes[0]
            self.trace_file.unlink(missing_ok=True)  # the router appends; start clean
            self.say(f"starting server: {' '.join(server.cmd)}")
            server.start()
            took = wait_ready(self.client_url + "/health", self.processes,
                              self.opts.startup_timeout_s,
                              workers=DeploymentSpec.parse(self.dep.epdserve).num_workers)
        else:
            took = self._start_processes()
        self.model = self._openai_model()
        self.say(f"ready after {took:.1f} s (model {self.model!r})")
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name=f"epdserve-watch-{self.dep.name}")
        self._watchdog.start()

    def _ready(self) -> tuple[str, int | None, float]:
        """``(url, status, timeout_s)``: the entry's check, else ``/v1/models`` answering 200
        within 300 s, or for a base_url any answer within :data:`BASE_URL_WAIT_S`."""
        if self.dep.ready:
            return self.dep.ready.url, self.dep.ready.status, self.dep.ready.timeout_s
        url = self.client_url + "/v1/models"
        return (url, None, BASE_URL_WAIT_S) if self.dep.base_url else (url, 200, 300.0)

    def _check_ports(self) -> None:
        """A server already listening would pass this deployment's ready check."""
        urls = [] if self.dep.base_url else [self.client_url, self._ready()[0]] + [
            p.ready.url for p in self.dep.processes or [] if p.ready]
        for url in urls:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            if parts.hostname in ("127.0.0.1", "localhost", "0.0.0.0") and not port_is_free(port):
                raise ServerError(f"port {port} on 127.0.0.1 is already in use; stop what "
                                  f"listens there" + (" or pass --port" if self.dep.epdserve
                                                      else f" (needed by {url})"))

    def _start_processes(self) -> float:
        """Seconds from first start to ready; a ServerError names the entry's
        ``setup`` command (a program failing at start is often not installed)."""
        try:
            return self._start_in_order()
        except ServerError as exc:
            if not self.dep.setup:
                raise
            raise ServerError(f"{exc.reason} (installed by `{self.dep.setup}`)",
                              exc.log_tail) from None

    def _start_in_order(self) -> float:
        started, took = [], 0.0
        for server, spec in zip(self.processes, self.dep.processes or []):
            self.say(f"starting {server.name}: {' '.join(server.cmd)}")
            server.start()
            started.append(server)
            if spec.ready:
                took += wait_ready(spec.ready.url, started, spec.ready.timeout_s,
                                   spec.ready.status)
        url, status, timeout_s = self._ready()
        return took + wait_ready(url, started, timeout_s, status)

    def _openai_model(self) -> str:
        async def first_id() -> str:
            async with client.make_client(1) as http:
                return await client.fetch_model_name(http, self.client_url)
        try:
            name = asyncio.run(first_id())
        except client.ServerUnreachable as exc:
            what = " ".join(str(exc).split())[:300]
            raise ServerError(f"{self.client_url} is not an OpenAI-compatible server "
                              f"(GET /v1/models must answer 200 with "
                              f'{{"data": [{{"id": ...}}]}}): {what}',
                              logs_tail([p.log_path for p in self.processes])) from None
        return self.model or name

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            if self._found_death():
                self._stop_processes()
                return

    def _found_death(self) -> bool:
        for p in self.processes:
            rc = p.poll()
            if rc is not None:
                self.died = {"process": p.name, "status": rc, "log": str(p.log_path),
                             "log_tail": log_tail(p.log_path)}
                return True
        return False

    def died_reason(self) -> str:
        d = self.died
        return (f"{d['process']} exited with status {d['status']} during the run; its other "
                f"processes were stopped (log: {d['log']})") if d else ""

    def resources(self) -> dict:
        """epdserve's from ``/health``, others' from the entry's ``resources``."""
        res = self.dep.resources or Resources()
        if self.dep.epdserve:
            found = self.processes[0].resources()
            return {**found, "device_kind": "core", "num_devices": found["num_cores"],
                    "price_per_hour": res.price_per_hour}
        return {"workers": [], "cores": [], "num_cores": res.cpu_cores,
                "device_kind": "GPU" if res.gpus else "core",
                "num_devices": res.gpus or res.cpu_cores, "price_per_hour": res.price_per_hour}

    def _stop_processes(self) -> None:
        with self._lock:  # the watchdog and stop() may both get here
            for p in reversed(self.processes):  # a proxy before the servers behind it
                p.stop()

    def stop(self) -> None:
        self._stopping.set()
        if self._watchdog is not None:  # it ran: a process may have died since its last look
            self._watchdog.join()
            if self.died is None:
                self._found_death()
        self._stop_processes()


@contextmanager
def launched(dep: Deployment, out_dir: Path, opts: LaunchOptions,
             say: Callable[[str], None] = print) -> Iterator[Running]:
    """Start ``dep`` and stop it however the block ends (Ctrl-C and SIGTERM included)."""
    running = Running(dep, out_dir, opts, say)
    try:
        running.start()
        yield running
    finally:
        running.stop()
