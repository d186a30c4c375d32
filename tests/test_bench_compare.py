"""``epdserve compare`` parts with real processes: server start/health/stop by process
group, one configuration run end to end against the stub server of
``test_bench_client.py`` (which takes ``epdserve serve``'s options and writes a trace),
the server-trace summary, the table and the plots. The real server is not needed."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epdserve.bench import compare, report, server_trace, workload
from test_bench_client import STUB_TTFT_S, bench_args, req

STUB = [sys.executable, str(Path(__file__).with_name("test_bench_client.py"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare_args(port: int, *extra: str):
    import argparse

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return parser.parse_args(["--port", str(port), "--disable-tqdm", "--startup-timeout", "30",
                              *extra])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_configurations_end_to_end_with_outputs(tmp_path):
    trace = [req(0.0, "one two"), req(0.05, "three FAIL400"), req(0.1, "a long one", kind="long"),
             req(0.15, "four five")]
    args = compare_args(free_port())
    entries = [compare.run_config(name, trace, args, tmp_path, serve=STUB)
               for name in ("colocated", "pd")]
    assert compare.port_is_free(args.port)  # both servers are gone

    for e in entries:
        r = e["result"]
        assert (r["completed"], r["failed"]) == (3, 1)
        assert all(t == 0 or t >= STUB_TTFT_S - 0.005 for t in r["ttfts"])
        # Joined by request id: the stub traced the warm-up and our three completed ones.
        assert e["server"]["num_records"] == 4
        assert e["server"]["matched_client_requests"] == 3
        assert (tmp_path / f"{e['name']}.server.log").exists()
    assert entries[0]["server"]["mean_kv_bytes"] == 0
    assert entries[1]["server"]["mean_kv_bytes"] == 4096
    assert entries[1]["server"]["p95_kv_transfer_ms"] == pytest.approx(2.5)

    files = compare.write_outputs(entries, trace, {"source": "test"}, tmp_path)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [e["name"] for e in saved] == ["colocated", "pd"]
    assert set(saved[0]) == {"name", "result", "server"}
    md = (tmp_path / "compare.md").read_text()
    assert "| Metric | colocated | pd | pd/colocated |" in md
    assert "KV bytes/req" in md and "- long: 1 requests" in md
    assert "| kv_bytes | 0.0 | 0.0 | 4,096.0 | 4,096.0 |" in md  # server-stage table
    for f in files:
        assert f.stat().st_size > 0
    for png in ("ttft_cdf.png", "itl_cdf.png", "itl_over_time.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_server_that_dies_gives_its_log_tail(tmp_path):
    dying = [sys.executable, "-c", "import sys; print('boom: unknown mode'); sys.exit(3)"]
    with pytest.raises(compare.ServerError, match="status 3") as info:
        compare.run_config("pd", [req(0.0, "x")], compare_args(free_port()), tmp_path,
                           serve=dying)
    assert "boom: unknown mode" in str(info.value)


def test_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(compare.ServerError, match=f"port {port}"):
            compare.run_config("colocated", [req(0.0, "x")], compare_args(port), tmp_path,
                               serve=STUB)


def test_stop_kills_the_whole_group_even_if_a_child_ignores_sigterm(tmp_path):
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(600)")
    cmd = ["sh", "-c", f"{sys.executable} -c \"{stubborn}\" & wait"]
    server = compare.ServerProcess("x", cmd, tmp_path / "x.log", "http://127.0.0.1:9")
    server.start()
    pgid = server.proc.pid
    try:
        deadline = time.monotonic() + 10
        while "ready" not in (tmp_path / "x.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        t = time.monotonic()
        server.stop(grace_s=0.5)
        assert time.monotonic() - t < 5
        deadline = time.monotonic() + 5
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILLed orphans are reaped by init
        assert not group_alive(pgid)
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ctrl_c_during_a_run_stops_the_server(tmp_path):
    port = free_port()
    script = (
        "import sys, argparse\n"
        "from pathlib import Path\n"
        "from epdserve.bench import compare, workload\n"
        "p = argparse.ArgumentParser(); compare.add_arguments(p)\n"
        f"args = p.parse_args(['--port', '{port}', '--disable-tqdm'])\n"
        "trace = [workload.Request(60.0, 'late', 4, 'chat', 1)]\n"
        f"compare.run_config('colocated', trace, args, Path({str(tmp_path)!r}),"
        f" serve={STUB!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "healthy" in line:
                break
        assert not compare.port_is_free(port)
        time.sleep(0.3)  # into the run
        proc.send_signal(signal.SIGINT)
        # Generous: stopping may wait out the server's 15 s SIGTERM grace on a loaded machine.
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert compare.port_is_free(port)
    finally:
        proc.kill()
        proc.wait()


def test_server_trace_summary_filters_to_this_runs_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"request_id": f"r{i}", "kv_bytes": 100 * i, "kv_transfer_ms": float(i),
             "prefill_ms": 10.0, "queue_ms": 0.0} for i in range(1, 5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    s = server_trace.summarize(path, ["r1", "r2", "r3", None])
    assert s["num_records"] == 4 and s["matched_client_requests"] == 3
    assert s["malformed_lines"] == 1
    assert s["mean_kv_bytes"] == pytest.approx(200)
    assert s["p95_kv_bytes"] == pytest.approx(290)  # linear between 200 and 300
    assert "mean_decode_ms" not in s
    assert server_trace.summarize(tmp_path / "absent.jsonl", ["r1"]) == {}


def test_table_ratio_column_and_missing_values():
    base = {"median_ttft_ms": 100.0, "failed": 0, "output_throughput": 50.0,
            "request_goodput": None}
    entries = [{"name": "colocated", "result": base, "server": {"mean_kv_bytes": 0.0}},
               {"name": "pd", "result": {**base, "median_ttft_ms": 150.0, "failed": 2},
                "server": {}}]
    header, rows = report.table(entries)
    assert header == ["Metric", "colocated", "pd", "pd/colocated"]
    by_label = {r[0]: r[1:] for r in rows}
    assert by_label["TTFT p50 (ms)"] == ["100.0", "150.0", "1.50x"]
    assert by_label["Failed requests"] == ["0", "2", "—"]
    assert by_label["KV bytes/req"] == ["0", "—", "—"]
    assert "Goodput req/s" not in by_label
    assert "TTFT p50 (ms)" in report.text_table(entries)


def test_compare_cli_bad_values_exit_2():
    for args, needle in ((["--configs", "colocated,colocated"], "named twice"),
                         (["--configs", "colocated,0p1d"], "0p1d"),
                         (["--port", "70000"], "70000"),
                         (["--trace", "/nonexistent.jsonl"], "/nonexistent.jsonl")):
        proc = subprocess.run([sys.executable, "-m", "epdserve", "compare", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_configuration_names_map_to_serve_flags():
    assert compare.serve_flags("pd") == ["--mode", "pd"]
    assert compare.serve_flags("colocated-2") == ["--mode", "colocated", "--workers", "2"]
    assert compare.serve_flags("2p1d") == ["--mode", "pd", "--prefill-workers", "2", "--decode-workers", "1"]
    assert compare.serve_flags("bogus") is None


def test_workload_description_of_a_trace():
    d = workload.describe([req(0.0, "a b"), req(2.5, "c d e", kind="long")])
    assert d["num_requests"] == 2 and d["long"]["offsets_s"] == [2.5]
    assert bench_args().endpoint == "chat"
