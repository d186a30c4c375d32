"""The client's TTFT is the server's plus the HTTP path, not the client's own delay.

A compare run started from a session at autogroup nice 19 measured deployments that
compare had started in sessions of their own, at nice 0: on 2 cores busy with colocated
workers its client got ~1.5% of a core and stood still for up to 10 s at a time (client
TTFT 8-19 s for a router TTFT of 0.2-1.5 s, results/elastic-s27/shift). Here:

* end to end, with real processes: a deployment compare starts gets compare's own CPU
  priority (the regression: it got nice 0 whatever compare's);
* in process: :class:`client.LoopLag` records a blocked event loop, and a run's late
  sends and stalls become the warning compare prints and puts in compare.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epdserve import host
from epdserve.bench import client, processes
from test_bench_client import req
from test_bench_compare import free_port
from test_bench_deployments import STUB, saved_trace, wait_for_file, write

NICE = 19  # the lowest priority: what the shared machine's sessions here run at


def test_autogroup_nice_reads_the_kernels_line(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "autogroup").write_text("/autogroup-1262 nice 19\n")
    assert host.autogroup_nice(7, tmp_path) == 19
    assert host.autogroup_nice(8, tmp_path) is None  # no such process (or no autogroups)


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(),
                    reason="the kernel has no scheduling autogroups (CONFIG_SCHED_AUTOGROUP)")
def test_a_deployment_runs_at_the_cpu_priority_of_the_compare_that_started_it(tmp_path):
    """compare runs in a session at autogroup nice 19; the server it starts (a session of
    its own, so that stopping it reaches its whole process group) must get nice 19 too,
    seen from /proc while the trace runs, and compare.json says so."""
    pid_file, port = tmp_path / "stub.pid", free_port()
    stub = ["sh", "-c", f"echo $$ > {pid_file}; exec {' '.join(STUB)} --port {port}"]
    path = write(tmp_path / "d.toml", (
        f'[[deployment]]\nname = "stub"\nopenai_base_url = "http://127.0.0.1:{port}/v1"\n'
        f'resources = {{ cpu_cores = 1 }}\n[[deployment.processes]]\ncommand = {json.dumps(stub)}\n'
        f'ready = {{ url = "http://127.0.0.1:{port}/health", timeout_s = 60 }}\n'))
    trace = saved_trace(tmp_path / "t.jsonl", [req(0.5 * i, f"count to {i}", 4) for i in range(8)])
    out = tmp_path / "out"
    compare = [sys.executable, "-m", "epdserve", "compare", "--deployments", str(path), "--trace",
               str(trace), "--output", str(out), "--warmup", "0", "--disable-tqdm", "--repeats", "1"]
    # The session's autogroup nice is set before compare starts: as a shell at nice 19 runs it.
    cmd = ["sh", "-c", f'echo {NICE} > /proc/self/autogroup && exec "$@"', "sh", *compare]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen, lines = None, []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "stub] sending" in line:
                # Read here, not with host's reader: the check must not rest on the code it checks.
                seen = Path(f"/proc/{wait_for_file(pid_file)}/autogroup").read_text().split()[-1]
                break
        rest, _ = proc.communicate(timeout=300)
        lines.append(rest)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = "".join(lines)
    assert proc.returncode == 0, log
    assert seen == str(NICE), f"the deployment ran at autogroup nice {seen}, compare at {NICE}\n{log}"
    (entry,) = json.loads((out / "compare.json").read_text())["configs"]
    priority = entry["host_load"]["priority"]
    assert priority["client_autogroup_nice"] == NICE and priority["error"] is None
    assert list(priority["deployment_autogroup_nice"].values()) == [NICE]
    assert entry["client"]["num_sends"] == 8 and entry["result"]["completed"] == 8
    assert processes.port_is_free(port)


def test_loop_lag_records_a_blocked_event_loop():
    """A synchronous 0.8 s call in the loop (what a starved or GIL-blocked client looks
    like from inside) is one stall of at least 0.8 s minus one probe interval."""
    lag = client.LoopLag(interval_s=0.05)

    async def run() -> None:
        lag.start()
        await asyncio.sleep(0.2)
        time.sleep(0.8)  # the loop cannot wake the probe meanwhile
        await asyncio.sleep(0.2)
        lag.stop()

    asyncio.run(run())
    found = lag.summary()
    assert found["samples"] >= 4
    assert len(found["stalls"]) == 1
    at_s, late_s = found["stalls"][0]
    assert 0.1 <= at_s <= 1.0 and late_s >= 0.8 - 0.05
    assert found["stalled_s"] == late_s and found["max_ms"] >= 750


def test_late_sends_and_stalls_become_the_runs_warning():
    """Sends compared with the trace's schedule: two of four sent 0.5 s or more late (the
    latest 8.3 s, as request 15 of colocated's shift run), plus a 10 s stall, give a warning
    that names both; a run on schedule has none."""
    from epdserve.bench.deployment_run import _client_delay
    requests = [req(t, "x", 4) for t in (0.0, 11.0, 110.4, 113.2)]
    loop = {"stalls": [[100.0, 10.0]], "stalled_s": 10.0}
    result = {"warmup_requests": 0, "max_concurrency": None,
              "start_offsets": [0.01, 11.2, 118.7, 113.7]}
    found = _client_delay(result, requests, loop)
    assert (found["late_sends"], found["num_sends"], found["max_send_late_s"]) == (2, 4, pytest.approx(8.3))
    assert "2 of 4 requests" in found["warning"] and "at most 8.3 s" in found["warning"]
    assert "stalled 10.0 s" in found["warning"]
    on_time = _client_delay({**result, "start_offsets": [0.0, 11.0, 110.5, 113.3]}, requests,
                            {"stalls": [], "stalled_s": 0.0})
    assert on_time["late_sends"] == 0 and on_time["warning"] is None
    # With --max-concurrency a send waits for a slot by design: not counted as late.
    capped = _client_delay({**result, "max_concurrency": 2}, requests, {"stalls": [], "stalled_s": 0.0})
    assert capped["num_sends"] == 0 and capped["warning"] is None
