"""serve's router process killed with kill -9 mid-stream, real processes: the stream in flight ends
with a connection error at once, serve restarts the router, the workers (the same processes, their
engines kept) join it, a request sent right after the kill waits for it and gets the fault-free greedy
text, and no KV block stays held."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from conftest import _stop, free_port, start_deployment
from test_faults_workers import Stream, wait_for
from test_serving_cleanup import wait_all_free

pytestmark = pytest.mark.faults

PROMPT = "Once upon a time, in a land far away,"


def test_a_killed_router_comes_back_and_its_workers_join_it_with_nothing_held(tmp_path):
    dep = start_deployment("pd", tmp_path, "--kv-cache-memory-mb", "128")
    try:
        expected = dep.generate("completion", PROMPT, stream=False, max_tokens=16, temperature=0).text
        workers = {w["worker_id"]: w["pid"] for w in dep.health()["workers"]}
        stream = Stream(dep.url, PROMPT, 2000)  # still decoding when the new router resets its worker
        stream.start()
        wait_for(lambda: len(stream.events) >= 10, 60, "10 streamed tokens")
        os.kill(dep.worker_pid("router"), signal.SIGKILL)
        killed = time.monotonic()
        stream.join(30)
        ended = time.monotonic() - killed
        after = dep.generate("completion", PROMPT, stream=False, max_tokens=16, temperature=0)  # waits for it
        served = time.monotonic() - killed

        assert stream.failure is not None or stream.error is not None  # its connection closed with the router
        assert after.text == expected
        assert {w["worker_id"]: w["pid"] for w in dep.health()["workers"]} == workers  # not restarted
        wait_all_free(dep.url)
        log = dep.log_tail(10**6)
        assert "the router: process exited with code -9; restarting it" in log
        assert "the router is back: ready at" in log and "dropped 1 requests" in log
        print(f"\nkill -9 of the router: the stream in flight ended {ended:.2f} s later; a request sent then "
              f"was answered {served:.1f} s after the kill")
    finally:
        _stop(dep.proc)


def _ready(url: str, procs: dict[str, subprocess.Popen]) -> bool:
    exited = [name for name, p in procs.items() if p.poll() is not None]
    assert not exited, f"{exited} exited (their logs are next to the test's)"
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _start(argv: list[str], log_path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "epdserve", *argv], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def test_a_router_lost_for_good_strands_no_kv_past_the_lease(tmp_path):
    """The router dies, never to come back, while a prefill worker holds a request's KV for a
    decode worker that has not taken it (stopped): the prefill worker frees it when ``--kv-ttl`` ends."""
    events, port = f"ipc://{tmp_path}/events", free_port()
    procs = {"router": _start(["router", "--mode", "pd", "--events", events, "--port", str(port)],
                              tmp_path / "router.log")}
    for role, core in (("prefill", 0), ("decode", 1)):
        procs[role] = _start(["worker", "--role", role, "--router", events, "--worker-id", f"{role}-0",
                              "--bind", f"ipc://{tmp_path}/{role}-0", "--cores", str(core), "--kv-ttl", "2",
                              "--kv-transport", "shm", "--kv-cache-memory-mb", "128"], tmp_path / f"{role}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url, procs), 300, "both workers up")
        os.kill(procs["decode"].pid, signal.SIGSTOP)  # it will not take the KV
        stream = Stream(url, PROMPT, 8)
        stream.start()
        prefill_log = tmp_path / "prefill.log"
        wait_for(lambda: stream.events, 30, "the prefill worker's first token")
        os.kill(procs["router"].pid, signal.SIGKILL)  # within --worker-timeout: nobody releases the KV
        killed = time.monotonic()
        wait_for(lambda: "not taken within 2 s; freed" in prefill_log.read_text(), 30, "the lease to end")
        freed = time.monotonic() - killed
        os.kill(procs["decode"].pid, signal.SIGCONT)
        stream.join(30)

        assert stream.failure is not None  # its connection closed with the router
        print(f"\nthe router killed holding a hand-off: the prefill worker freed the KV {freed:.1f} s later "
              "(--kv-ttl 2)")
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
