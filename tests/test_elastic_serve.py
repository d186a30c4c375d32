"""``epdserve serve --elastic`` end to end, real processes and the ``openai``
client: two workers switch role live under a steady stream of requests, in every
direction (colocated -> prefill / decode, prefill <-> decode, and back to colocated),
with no failed request, every greedy text unchanged, nothing held at the end, and each
switch in the trace and /metrics; a worker killed while switching is restarted by the
launcher (in its first role) and switched back by the router to the role it last
announced. ``--max-workers`` is refused where it cannot apply. The switches are asked by ``POST /roles``
(``--elastic-interval 0``: no controller), so each direction is taken on purpose.
``make elastic``."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import _stop, cli_exit, start_deployment

pytestmark = pytest.mark.elastic

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "The three primary colors are"]
MAX_TOKENS = 24
STREAM_LIMIT_S = 240.0  # the stream runs while the switches happen, never longer
STEPS = [  # (worker-0's role, worker-1's role) after each switch: every direction once
    ("prefill", "decode"),    # colocated -> prefill, colocated -> decode
    ("decode", "prefill"),    # prefill -> decode, decode -> prefill
    ("colocated", "colocated"),  # decode -> colocated, prefill -> colocated
]


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    dep = start_deployment("colocated", tmp_path_factory.mktemp("elastic"), "--workers", "2", "--elastic",
                           "--elastic-interval", "0")
    try:
        yield dep
    finally:
        _stop(dep.proc)


def _complete(dep, prompt: str, max_tokens: int = MAX_TOKENS):
    return dep.generate("completion", prompt, stream=True, max_tokens=max_tokens, temperature=0.0,
                        extra_body={"ignore_eos": True})


def _workers(dep) -> dict[str, dict]:
    return {w["worker_id"]: w for w in dep.health()["workers"]}


def _switch(dep, worker: str, role: str, timeout_s: float = 60.0) -> None:
    """POST /roles; a 409 while another worker's prefills wait for their hand-off to this one
    (the decode stage never returns to the worker that prefilled) is asked again."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(dep.url + "/roles", json={"worker_id": worker, "role": role, "reason": "test"}, timeout=10)
        if r.status_code != 409 or "try again" not in r.text or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.2)


def _events(dep, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in dep.trace_path.read_text().splitlines()]
    return [line for line in lines if line.get("event") == kind]


class Stream:
    """Two client threads sending the prompts in turn until stopped (bounded by
    STREAM_LIMIT_S); every outcome kept as (prompt, text or the exception)."""

    def __init__(self, dep):
        self.dep, self.stop, self.results = dep, threading.Event(), []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]
        for t in self.threads:
            t.start()

    def _run(self, offset: int) -> None:
        deadline, i = time.monotonic() + STREAM_LIMIT_S, offset
        while not self.stop.is_set() and time.monotonic() < deadline:
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                self.results.append((prompt, _complete(self.dep, prompt).text))
            except Exception as exc:  # kept, asserted on
                self.results.append((prompt, exc))
            i += 1

    def end(self) -> list:
        self.stop.set()
        for t in self.threads:
            t.join(STREAM_LIMIT_S)
        return self.results


def test_switches_in_every_direction_under_a_steady_stream(elastic):
    dep = elastic
    expected = {p: _complete(dep, p).text for p in PROMPTS}  # served colocated
    stream = Stream(dep)
    try:
        for roles in STEPS:
            time.sleep(2.0)  # requests in flight on every worker when the switch comes
            for worker, role in zip(("worker-0", "worker-1"), roles):
                _switch(dep, worker, role)
            _wait(lambda: all(not w["switching"] for w in _workers(dep).values()), f"switch to {roles}")
            ws = _workers(dep)
            assert (ws["worker-0"]["announced_role"], ws["worker-1"]["announced_role"]) == roles
    finally:
        results = stream.end()
    failed = [(p, r) for p, r in results if isinstance(r, Exception)]
    assert not failed, failed[:3]
    assert len(results) >= 12, f"only {len(results)} requests ran during the switches"
    changed = [(p, r) for p, r in results if r != expected[p]]
    assert not changed, changed[:3]
    _wait(lambda: all(w["blocks_in_use"] == 0 and w["outstanding"] == 0 for w in _workers(dep).values()),
          "every KV block free", 30)
    switched = [(e["worker"], e["previous"], e["role"]) for e in _events(dep, "role") if e["state"] == "switched"]
    directions = {(prev, role) for _, prev, role in switched}
    assert directions == {("colocated", "prefill"), ("colocated", "decode"), ("prefill", "decode"),
                          ("decode", "prefill"), ("decode", "colocated"), ("prefill", "colocated")}, switched
    assert all(e["drain_ms"] >= 0 for e in _events(dep, "role") if e["state"] == "switched")
    paths = {json.loads(line).get("path") for line in dep.trace_path.read_text().splitlines()}
    assert {"colocated", "disaggregated"} <= paths, paths
    metrics = httpx.get(dep.url + "/metrics", timeout=10).text
    total = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("epdserve:role_switches_total{"))
    assert total == 6, total
    role_lines = re.findall(r'^epdserve:worker_role\{engine="([\w-]+)",model_name="[^"]*",role="\w+",'
                            r'worker="([\w-]+)"\} ', metrics, re.M)
    assert role_lines and all(engine == worker for engine, worker in role_lines), role_lines
    assert "epdserve:role_switch_drain_seconds_count" in metrics
    # A worker's gauges live under its role now only: an old role's last values would read as
    # blocks held forever.
    roles = {wid: w["role"] for wid, w in _workers(dep).items()}
    gauges = {(m["engine"], m["worker"], m["role"], float(m["value"])) for m in re.finditer(
        r'^epdserve:kv_blocks_in_use\{engine="(?P<engine>[\w-]+)",model_name="[^"]*",role="(?P<role>\w+)",'
        r'worker="(?P<worker>[\w-]+)"\} (?P<value>\S+)$', metrics, re.M)}
    assert gauges == {(wid, wid, role, 0.0) for wid, role in roles.items()}, gauges


def test_bad_role_requests(elastic):
    """POST /roles with bad input: 400/404 with an OpenAI-style body, nothing switched."""
    dep = elastic
    for body, status in [({"worker_id": "worker-0", "role": "encode"}, 400), ({"worker_id": "nope", "role": "decode"}, 404),
                         ({"worker_id": "worker-0", "role": "decode", "extra": 1}, 400), ({"role": "decode"}, 400)]:
        r = httpx.post(dep.url + "/roles", json=body, timeout=10)
        assert r.status_code == status and "error" in r.json(), (body, r.status_code, r.text)
    forged = {"worker_id": "worker-0", "role": "decode", "reason": "x\n2026-12-02 ERROR epdserve.router: forged"}
    r = httpx.post(dep.url + "/roles", json=forged, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reason", r.text
    assert {w["role"] for w in _workers(dep).values()} == {"colocated"}
    # A prefill worker alone serves nothing: the last worker that can decode stays one.
    _switch(dep, "worker-0", "prefill")
    r = httpx.post(dep.url + "/roles", json={"worker_id": "worker-1", "role": "prefill"}, timeout=10)
    assert r.status_code == 409 and "last live worker that can decode" in r.json()["error"]["message"], r.text
    _switch(dep, "worker-0", "colocated")
    _wait(lambda: all(not w["switching"] for w in _workers(dep).values()), "colocated again")
    assert {w["role"] for w in _workers(dep).values()} == {"colocated"}


def test_a_worker_killed_while_switching_comes_back_in_its_last_announced_role(elastic):
    """worker-0 announced decode (worker-1 prefill); while it drains a long decode towards
    colocated it is killed: the launcher restarts it (in its first role, colocated) and the
    router switches it back at its Hello to decode, its last announced role, not to the one
    it was switching to."""
    dep = elastic
    _switch(dep, "worker-0", "decode")
    _switch(dep, "worker-1", "prefill")
    _wait(lambda: all(not w["switching"] for w in _workers(dep).values()), "1P1D")
    long_request = threading.Thread(target=lambda: _try(lambda: _complete(dep, PROMPTS[1], 600)), daemon=True)
    long_request.start()
    _wait(lambda: _workers(dep)["worker-0"]["outstanding"] > 0, "the long request decoding on worker-0")
    _switch(dep, "worker-0", "colocated")
    assert _workers(dep)["worker-0"]["switching"], "it drains its decode first"
    before = len(_events(dep, "role"))
    os.kill(dep.worker_pid("worker-0"), signal.SIGKILL)
    _wait(lambda: any(e["worker"] == "worker-0" and e["state"] == "switched" for e in _events(dep, "role")[before:]),
          "the killed worker restarted and back in its role", 180)
    w = _workers(dep)["worker-0"]
    assert (w["state"], w["role"], w["announced_role"], w["switching"]) == ("up", "decode", "decode", False)
    after = [(e["state"], e["role"], e["reason"]) for e in _events(dep, "role")[before:] if e["worker"] == "worker-0"]
    assert after == [("up", "colocated", None),
                     ("switching", "decode", "restarted: back to its last announced role decode"),
                     ("switched", "decode", "restarted: back to its last announced role decode")], after
    long_request.join(60)
    assert _complete(dep, PROMPTS[0]).text == _complete(dep, PROMPTS[0]).text  # serving again, in 1P1D


def _try(fn) -> None:
    try:
        fn()
    except Exception:  # the long request dies with its worker: expected
        pass


@pytest.mark.parametrize("extra,message", [
    (["--max-workers", "3"], "--max-workers 3: workers are added and retired only with --elastic"),
    (["--elastic", "--workers", "2", "--max-workers", "1"], "--max-workers 1: below the 2 starting workers"),
    (["--elastic", "--workers", "2", "--max-workers", "3"], "--max-workers 3: adding workers needs --cluster ray"),
    (["--mode", "pd", "--slo", "ttft:100", "--elastic-window", "5"],
     "--slo, --elastic-window: the elastic controller's settings apply only with --elastic"),
    (["--elastic", "--workers", "2", "--slo", "ttft:100", "ttft:5000"], "--slo: ttft given more than once"),
    (["--elastic", "--mode", "pd", "--prefill-dtype", "bfloat16"],
     "--prefill-dtype: an elastic worker changes role, so every worker takes --dtype, --device and "
     "--kv-cache-dtype"),
])
def test_elastic_flags_refused_where_they_cannot_apply(extra, message):
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--port", "0", *extra], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra,message", [
    (["--elastic-interval", "0.01"], "'0.01': must be 0 or a finite number >= 0.1"),
    (["--elastic-min-dwell", "0"], "'0': must be a finite number > 0"),
    (["--slo", "ttft:0"], "'ttft:0': SLO must be a finite number > 0 ms"),
    (["--slo", "ttft_ms:2000"], "expected KEY:MS with KEY one of ttft, tpot"),
])
def test_elastic_flag_values_refused_by_the_parser(capsys, extra, message):
    code, err = cli_exit(capsys, ["serve", "--elastic", "--workers", "2", *extra])
    assert code == 2 and message in err, err
