"""Shared fixtures: the model's tokenizer, and real deployments started with
``epdserve serve`` (session-scoped: a 1P1D one, a colocated one, and a 2P2D one with its
events socket on TCP and an auth token, for the multi-worker and fault tests), each on a
free port, stopped at the end of the session even when tests fail.

Markers from what a test starts (:func:`pytest_collection_modifyitems`): ``server`` on a
test that starts real server processes, ``cluster`` on one that starts a Ray cluster,
through its fixtures or the helpers it calls."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

READY = re.compile(r"epdserve serve: ready at (http://\S+)")
STARTUP_TIMEOUT_S = float(os.environ.get("EPDSERVE_TEST_STARTUP_TIMEOUT", "300"))
AUTH_TOKEN = "test-token"


def generate(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Run ``prompts`` through an :class:`~epdserve.engine.engine.LLMEngine` together with
    ``params`` (SamplingParams); each one's generated token ids."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.token_ids)
    return [outputs[str(i)] for i in range(len(prompts))]


def cli_exit(capsys, argv: list[str]) -> tuple[int, str]:
    """``epdserve ARGV`` through its CLI entry point, in-process, expected to exit (an
    argument error: argparse's SystemExit): (exit status, stderr)."""
    from epdserve import cli
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    return exit_.value.code, capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model_info():
    from epdserve.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_info):
    from epdserve.model.tokenizer import load_tokenizer

    return load_tokenizer(model_info.path)


@dataclass
class Deployment:
    """A running ``epdserve serve``: ``url`` (no trailing slash), its log and trace files."""

    mode: str
    url: str
    proc: subprocess.Popen
    log_path: Path
    trace_path: Path
    events: str | None = None  # the router's events address when given on the command line

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def worker_pid(self, worker_id: str) -> int:
        """Pid of the launcher's child process running ``worker_id``."""
        from epdserve.host import child_pids

        pid = child_pids(self.proc.pid).get(worker_id)
        if pid is None:
            raise LookupError(f"no process for worker {worker_id}")
        return pid

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300, **kw)

    def generate(self, kind: str, prompt, *, stream: bool, model: str | None = None, **params) -> "Result":
        """One request through the ``openai`` package: ``kind`` "chat" (``prompt`` = messages)
        or "completion" (a string or token ids); ``params`` go to ``create`` (use
        ``extra_body`` for ``ignore_eos``). Streams ask for usage."""
        client = self.openai()
        model = model or client.models.list().data[0].id
        if kind == "chat":
            create, kw = client.chat.completions.create, {"messages": prompt}
        else:
            create, kw = client.completions.create, {"prompt": prompt}
        if not stream:
            resp = create(model=model, stream=False, **kw, **params)
            choice = resp.choices[0]
            text = choice.message.content if kind == "chat" else choice.text
            return Result(resp.id, text, choice.finish_reason, resp.usage, 1)
        chunks = list(create(model=model, stream=True, stream_options={"include_usage": True}, **kw, **params))
        pieces, finish = [], None
        for c in chunks:
            if c.choices:
                piece = c.choices[0].delta.content if kind == "chat" else c.choices[0].text
                pieces.append(piece or "")
                finish = c.choices[0].finish_reason or finish
        assert len({c.id for c in chunks}) == 1, "every chunk carries the same id"
        return Result(chunks[0].id, "".join(pieces), finish, chunks[-1].usage, len(chunks))

    def trace(self, request_id: str, timeout: float = 10.0) -> dict:
        """The trace record of ``request_id`` (waits for it to be written)."""
        import json

        deadline = time.monotonic() + timeout
        while True:
            if self.trace_path.exists():
                for line in self.trace_path.read_text().splitlines():
                    rec = json.loads(line)
                    if rec.get("request_id") == request_id:  # (elastic servers also write event lines)
                        return rec
            if time.monotonic() > deadline:
                raise AssertionError(f"no trace record for {request_id} in {self.trace_path}")
            time.sleep(0.1)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@dataclass
class Result:
    id: str
    text: str
    finish_reason: str | None
    usage: object  # openai's CompletionUsage
    num_chunks: int


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (it stops its workers), SIGKILL its group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C the launcher and wait for it to stop its workers (SIGKILL its group if it hangs)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    finally:
        _stop(proc)


def start_deployment(mode: str, directory: Path, *extra: str, env: dict | None = None,
                     cores: set[int] | None = None) -> Deployment:
    """Start ``epdserve serve --mode MODE --port 0`` and wait for its URL and /health
    (``env`` is added to its environment; ``cores``: the CPU cores the launcher, its router
    and so its workers may use, default all).

    Raises:
        RuntimeError: it exited or did not become healthy in time (the log tail says why).
    """
    log_path, trace_path = directory / f"serve-{mode}.log", directory / f"trace-{mode}.jsonl"
    argv = [sys.executable, "-m", "epdserve", "serve", "--mode", mode, "--host", "127.0.0.1",
            "--port", "0", "--trace-file", str(trace_path), *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **(env or {})),
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    events = extra[extra.index("--events") + 1] if "--events" in extra else None
    dep = Deployment(mode, "", proc, log_path, trace_path, events)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not dep.url:
            match = READY.search(dep.log_tail(10**9))
            if match:
                dep.url = match.group(1)
                break
            if proc.poll() is not None:
                raise RuntimeError(f"epdserve serve --mode {mode} exited with {proc.returncode}:\n{dep.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"epdserve serve --mode {mode} not ready in {STARTUP_TIMEOUT_S:.0f} s:\n"
                                   f"{dep.log_tail()}")
            time.sleep(0.3)
        while httpx.get(dep.url + "/health", timeout=10).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"/health of {mode} never returned 200:\n{dep.log_tail()}")
            time.sleep(0.3)
        return dep
    except BaseException:
        _stop(proc)
        raise


def _deployment_fixture(mode: str, tmp_path_factory):
    dep = start_deployment(mode, tmp_path_factory.mktemp(f"serve-{mode}"))
    try:
        yield dep
    finally:
        _stop(dep.proc)


@pytest.fixture(scope="session")
def pd_server(tmp_path_factory):
    yield from _deployment_fixture("pd", tmp_path_factory)


@pytest.fixture(scope="session")
def colocated_server(tmp_path_factory):
    yield from _deployment_fixture("colocated", tmp_path_factory)


@pytest.fixture(scope="session")
def xpyd_server(tmp_path_factory):
    """2 prefill + 2 decode workers sharing the 2 cores, small KV pools, events on TCP (so
    tests can start extra workers and send frames to it), workers proven by AUTH_TOKEN; a worker's
    death fails its requests mid-stream (no migration: tests/test_faults_migration.py has it)."""
    dep = start_deployment("pd", tmp_path_factory.mktemp("serve-2p2d"), "--prefill-workers", "2",
                           "--decode-workers", "2", "--kv-cache-memory-mb", "128", "--migration-limit", "0",
                           "--events", f"tcp://127.0.0.1:{free_port()}",
                           env={"EPDSERVE_AUTH_TOKEN": AUTH_TOKEN})
    try:
        yield dep
    finally:
        _stop(dep.proc)


@pytest.fixture(params=["pd", "colocated"])
def server(request):
    """Each test using it runs once against each deployment."""
    return request.getfixturevalue(f"{request.param}_server")


# What starts real processes, by the name code calls it by: a deployment and its workers
# (start_deployment; processes.launched for a deployment file's servers), a Ray node
# (test_ray.RayNode). A test gets the marker when its function, a fixture it uses, or a
# function of tests/ that one of them calls (at any depth) names one of these. Tests that
# start processes some other way carry the marker themselves.
STARTERS = {"server": {"start_deployment", "launched"}, "cluster": {"RayNode"}}
# Fixtures that start one by a name only known when they run (request.getfixturevalue).
STARTING_FIXTURES = {"server": {"server"}, "cluster": set()}
TESTS_DIR = Path(__file__).resolve().parent


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the functions defined in it use."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out


def _calls(fn, starters: set[str], seen: set) -> bool:
    """Whether ``fn`` names one of ``starters``, itself or through the functions of tests/ it names."""
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType) or fn in seen:
        return False
    seen.add(fn)
    names = _names(fn.__code__)
    if names & starters:
        return True
    return any(isinstance(helper := fn.__globals__.get(name), types.FunctionType)
               and Path(helper.__code__.co_filename).resolve().parent == TESTS_DIR
               and _calls(helper, starters, seen) for name in names)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by them
def pytest_collection_modifyitems(items):
    """Add ``server`` and ``cluster`` to the tests that start them (see :data:`STARTERS`)."""
    for item in items:
        fixturedefs = getattr(item, "_fixtureinfo", None)
        fixturedefs = fixturedefs.name2fixturedefs if fixturedefs else {}
        functions = [getattr(item, "function", None)]
        functions += [d.func for defs in fixturedefs.values() for d in defs]
        for marker, starters in STARTERS.items():
            if (STARTING_FIXTURES[marker] & set(getattr(item, "fixturenames", ()))
                    or any(_calls(fn, starters, set()) for fn in functions)):
                item.add_marker(marker)
