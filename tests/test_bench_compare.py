"""``epdserve compare`` parts with real processes: server start/health/stop by process
group, one configuration run end to end against the stub server of
``test_bench_client.py`` (which takes ``epdserve serve``'s options and writes a trace),
the server-trace summary and TTFT breakdown, the table, the report and the plots. Only
the cores test uses the real server (the session's 1P1D fixture)."""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epdserve import host
from epdserve.argtypes import config_from
from epdserve.bench import compare, processes, report, server_trace, workload
from epdserve.serving.deployment import DeploymentSpec
from epdserve.trace import RequestTrace
from conftest import cli_exit
from test_bench_client import STUB_TTFT_S, bench_args, req
from epdserve.bench.traces import describe

STUB = [sys.executable, str(Path(__file__).with_name("test_bench_client.py"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare_args(port: int, *extra: str):
    import argparse

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return config_from(compare.CompareOptions, parser.parse_args(
        ["--port", str(port), "--disable-tqdm", "--startup-timeout", "30", "--repeats", "1", *extra]))


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
    assert processes.port_is_free(args.port)  # both servers are gone

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

    # Stub records: a queue of 1 ms, prefill_ms = STUB_TTFT_S, no ttft_ms; pd: the prefill
    # worker's queue, a KV export of 0.5 ms and a hand-off (fetch 1 + import 1 ms).
    for e, queue, export in zip(entries, ("queue", "prefill queue"), ([], ["KV export"])):
        b = e["breakdown"]
        assert b["joined"] == 3
        assert b["ttft"]["parts"] == [queue, "prefill", *export, "other"]
        assert b["ttft"]["mean"][queue] == pytest.approx(1.0)
        assert b["ttft"]["mean"]["prefill"] == pytest.approx(1000 * STUB_TTFT_S)
        client_ms = [t * 1000 for t, err in zip(e["result"]["ttfts"], e["result"]["errors"])
                     if not err]
        assert sum(b["ttft"]["mean"].values()) == pytest.approx(sum(client_ms) / 3)
        assert e["itl_stalls"] == 0
        # The stub's /health lists no workers: no cores known, and so no devices.
        assert e["resources"] == {"workers": [], "cores": [], "num_cores": None,
                                  "device_kind": "core", "num_devices": None,
                                  "price_per_hour": None}
        assert e["deployment"] == {"name": e["name"], "epdserve": e["name"], "source": "--configs"}
        assert e["metrics_urls"] == [f"http://127.0.0.1:{args.port}/metrics"]
        assert "per_core" not in e and "died" not in e
        load = e["host_load"]  # the load on the cores before and during the run
        assert load["cores"] == sorted(os.sched_getaffinity(0))
        assert set(load["before"]) == {"window_s", "loadavg_1m", "outside_share", "steal_share"}
        assert set(load["during"]) >= {"loadavg_1m_mean", "deployment_cpu_s", "client_cpu_s",
                                       "outside_cpu_s", "outside_share", "steal_share"}
        assert load["during"]["client_cpu_s"] > 0 and load["during"]["wall_s"] > 0
    assert entries[0]["breakdown"]["handoff"] is None
    assert entries[1]["breakdown"]["handoff"]["mean"]["KV import"] == pytest.approx(1.0)
    # As if other processes had taken 30% of the cores during pd's run, none during the other
    # (this machine may well be busy).
    entries[0]["host_load"]["warning"] = None
    entries[1]["host_load"]["warning"] = host.outside_warning(0.3, 0.0, 2)

    failed = {"name": "2p1d", "mode": "pd", "error": "server exited with status 1"}
    files = compare.write_outputs([*entries, failed], trace, {"source": "test"}, tmp_path,
                                  {"temperature": 0.0})
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert [e["name"] for e in saved["configs"]] == ["colocated", "pd", "2p1d"]
    assert saved["sampling"] == {"temperature": 0.0}
    assert saved["trace"]["num_requests"] == 4 and len(saved["trace"]["sha256"]) == 64
    assert saved["recommendation"]["not_considered"]["2p1d"] == "server exited with status 1"
    assert saved["recommendation"]["choice"] in ("colocated", "pd")
    assert saved["configs"][1]["host_load"]["during"] == entries[1]["host_load"]["during"]
    md = (tmp_path / "compare.md").read_text()
    assert "**Warning, the measurement may be disturbed:** pd: other processes used 30% of the 2 cores" in md
    assert md.count("- host load on cores") == 2
    assert report.load_warnings(entries) == [f"pd: {host.outside_warning(0.3, 0.0, 2)}"]
    assert "| Metric | Better | colocated | pd | pd (x of colocated) |" in md
    assert "| KV per request (MB, mean) | lower | 0.00 | 0.00 | — |" in md
    assert "- long: 1 requests" in md
    assert "| kv_bytes | 0.0 | 0.0 | 4,096.0 | 4,096.0 |" in md  # server-stage table
    assert "**2p1d failed:** `server exited with status 1`" in md
    assert "| queue | 1.0 | 1.0 | — | — |" in md  # TTFT breakdown table
    assert "| prefill queue | — | — | 1.0 | 1.0 |" in md
    assert "Prefix caching is on unless" in md
    assert "--sweep-rates LO:HI" in md  # how to get goodput vs rate
    assert md.split("## Who wins at which SLOs")[0].rstrip().splitlines()[-1].startswith("Rule: ")
    assert "No map: configuration 'colocated' has no per-request outcomes" in md  # run_config's entries keep none
    assert "## Recommendation" in md
    for f in files:
        assert f.stat().st_size > 0
    for png in ("ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "stages.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "goodput_vs_rate.png").exists()


def test_an_image_workload_through_colocated_and_epd(tmp_path):
    from test_bench_client import image_req

    trace = [image_req("one", 0, 1), image_req("two", 2, 3), req(0.05, "text only")]
    args = compare_args(free_port())
    entries = [compare.run_config(name, trace, args, tmp_path, serve=STUB)
               for name in ("colocated", "1e1p1d")]
    colocated, epd = entries
    assert epd["mode"] == "epd" and all(e["result"]["completed"] == 3 for e in entries)
    # Image keys summarised over the two requests with images (two images each).
    assert epd["server"]["mean_num_images"] == 2
    assert epd["server"]["mean_embedding_bytes"] == 2000
    assert epd["server"]["mean_embedding_bytes_per_image"] == 1000
    assert epd["server"]["mean_embedding_transfer_ms_per_image"] == pytest.approx(0.25)
    assert colocated["server"]["mean_embedding_bytes"] == 0
    for e in entries:
        t = e["breakdown"]["ttft"]
        assert t["parts"][:3] == ["encode queue", "encode", "embedding transfer"]
        assert t["mean"]["encode"] == pytest.approx(2.0)  # 3 ms on 2 of the 3 requests
    assert epd["breakdown"]["ttft"]["mean"]["embedding transfer"] == pytest.approx(1 / 3)
    compare.write_outputs(entries, trace, {"source": "test"}, tmp_path)
    md = (tmp_path / "compare.md").read_text()
    assert "| Embeddings per request (MB, mean) | lower | 0.000 | 0.002 | — |" in md
    assert "| encode | 2.0 | 3.0 | 2.0 | 3.0 |" in md
    assert "- 4 images (4 distinct)" in md


def test_goodput_sweep_per_configuration_against_the_stub(tmp_path):
    trace = [req(0.0, "one"), req(0.05, "two"), req(0.1, "three"), req(0.15, "four")]
    args = compare_args(free_port(), "--goodput", "ttft:10000", "--sweep-rates", "2:8",
                        "--sweep-iters", "0")
    e = compare.run_config("pd", trace, args, tmp_path, serve=STUB)
    sw = e["sweep"]
    assert [p["rate"] for p in sw["points"]] == [2.0, 8.0]
    assert all(p["slo_attainment"] == 1.0 for p in sw["points"])  # the stub is fast
    assert sw["max_rate"] == 8.0
    assert e["result"]["request_goodput"] is not None
    assert e["server"]["matched_client_requests"] == 4  # the sweep's requests not mixed in
    # Each rate on a fresh start (a warm prefix cache would hold the trace's prompts).
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["pd-2", "pd-8"]
    assert all((tmp_path / "sweep" / d / "pd.server.log").is_file() for d in ("pd-2", "pd-8"))
    assert all("host_load" in p for p in sw["points"])
    paths = compare.write_outputs([e], trace, {"source": "test"}, tmp_path)
    assert tmp_path / "goodput_vs_rate.png" in paths
    assert "- pd: max rate with 90% of requests within the SLOs: 8 req/s (the highest rate " \
        "tried: raise HI)" in \
        (tmp_path / "compare.md").read_text()


def test_resources_lists_each_workers_cores(pd_server, tmp_path):
    res = processes.ServerProcess("pd", [], tmp_path / "x.log", pd_server.url).resources()
    roles = {w["role"]: set(w["cores"]) for w in res["workers"]}
    assert set(roles) == {"prefill", "decode"}
    assert roles["prefill"] and roles["decode"]
    assert res["cores"] == sorted(roles["prefill"] | roles["decode"])
    assert res["num_cores"] == len(res["cores"])
    assert {w["kv_dtype"] for w in res["workers"]} == {"float32"}  # the model's: --kv-cache-dtype auto


def client_result(ttfts_s, itls_s, ids, errors=None):
    """A bench result with just what the breakdown reads (times in seconds)."""
    return {"ttfts": ttfts_s, "itls": itls_s, "request_ids": ids,
            "errors": errors or [""] * len(ids)}


def test_breakdown_joins_by_id_and_splits_ttft_and_the_handoff_gap():
    result = client_result([0.500, 0.300, 0.0, 0.100], [[0.200, 0.05], [0.1], [], [0.05]],
                           ["chatcmpl-a", "chatcmpl-b", "chatcmpl-c", "chatcmpl-d"],
                           ["", "", "HTTP 500", ""])
    lines = [
        # a: PD with a hand-off; the router saw TTFT 490 ms of the client's 500.
        {"request_id": "chatcmpl-a", "mode": "pd", "path": "disaggregated", "ttft_ms": 490.0,
         "router_queue_ms": 5.0, "prefill_queue_ms": 20.0, "prefill_ms": 400.0,
         "kv_export_ms": 30.0, "router_hop_ms": 2.0, "kv_fetch_ms": 8.0,
         "kv_import_ms": 10.0, "decode_queue_ms": 40.0},
        # b: an older trace (no path, no ttft_ms): pd mode means disaggregated; no http part.
        {"request_id": "b", "mode": "pd", "router_queue_ms": 1.0, "prefill_ms": 250.0},
        {"request_id": "c", "mode": "pd", "prefill_ms": 1.0},  # failed on the client: skipped
        # d: prefilled by the decode worker itself: its queue is the decode queue, no hand-off.
        {"request_id": "d", "mode": "pd", "path": "local", "ttft_ms": 95.0,
         "router_queue_ms": 2.0, "decode_queue_ms": 3.0, "prefill_ms": 80.0},
        {"request_id": "zzz", "prefill_ms": 1.0},  # another run's request
    ]
    records = [RequestTrace.from_json(line) for line in lines]
    b = server_trace.breakdown(result, records)
    assert b["joined"] == 3
    t = b["ttft"]
    assert t["parts"] == ["http", "router", "prefill queue", "decode queue", "prefill",
                          "KV export", "IPC hops", "other"]
    # a: http 10, router 5, queue 20, prefill 400, export 30, hops 490-455 = 35, other 0
    # b: router 1, prefill 250, no hops (no ttft_ms), other 300-251 = 49 (the parts it
    #    lacks count 0)
    # d: http 5, router 2, decode queue 3, prefill 80, hops 95-85 = 10, other 0
    assert t["mean"] == pytest.approx({"http": 5.0, "router": 8 / 3, "prefill queue": 20 / 3,
                                       "decode queue": 1.0, "prefill": 730 / 3,
                                       "KV export": 10.0, "IPC hops": 15.0, "other": 49 / 3})
    assert sum(t["mean"].values()) == pytest.approx(900 / 3)  # the client's mean TTFT
    assert t["p95"]["other"] == pytest.approx(0.9 * 49)  # linear in [0, 0, 49]
    h = b["handoff"]
    assert h["n"] == 1  # only a has kv_import_ms
    assert h["parts"] == ["router hop", "KV fetch", "decode queue", "KV import", "other"]
    assert h["mean"] == pytest.approx({"router hop": 2.0, "KV fetch": 8.0, "KV import": 10.0,
                                       "decode queue": 40.0, "other": 140.0})
    assert server_trace.breakdown(client_result([0.1], [[]], ["x"]), records) == \
        {"joined": 0, "ttft": None, "handoff": None}


def epd_record(rid, **extra):
    """A router trace line of an EPD request with one image whose stages add up to its
    ttft_ms (300): router 2 + encode queue 5 + encode 120 + embedding transfer 3 (export 1
    + fetch 2) + prefill queue 10 + prefill 140 + KV export 8 + hops 12 (derived)."""
    return {"request_id": rid, "mode": "epd", "path": "disaggregated", "ttft_ms": 300.0,
            "router_queue_ms": 2.0, "num_images": 1, "encode_queue_ms": 5.0,
            "encode_ms": 120.0, "embedding_bytes": 331776, "embedding_export_ms": 1.0,
            "embedding_fetch_ms": 2.0, "prefill_queue_ms": 10.0, "prefill_ms": 140.0,
            "kv_export_ms": 8.0, "kv_bytes": 1_000_000, **extra}


def test_breakdown_puts_image_encoding_in_its_own_stages(tmp_path):
    lines = [epd_record("a"), epd_record("b", encode_queue_ms=25.0, ttft_ms=320.0),
             # text-only in the same run: no image keys, so no encode parts (never 0s
             # guessed into its record; they count 0 in the means like any absent part)
             {"request_id": "c", "mode": "epd", "path": "disaggregated", "ttft_ms": 150.0,
              "router_queue_ms": 2.0, "prefill_queue_ms": 1.0, "prefill_ms": 140.0,
              "kv_export_ms": 2.0}]
    records = [RequestTrace.from_json(line) for line in lines]
    # The client saw 4 ms more than the router (HTTP) on every request.
    b = server_trace.breakdown(client_result([0.304, 0.324, 0.154], [[0.1], [0.1], [0.1]],
                                             ["chatcmpl-a", "chatcmpl-b", "chatcmpl-c"]), records)
    t = b["ttft"]
    assert t["parts"] == ["http", "router", "encode queue", "encode", "embedding transfer",
                          "prefill queue", "prefill", "KV export", "IPC hops", "other"]
    assert t["mean"] == pytest.approx({
        "http": 4.0, "router": 2.0, "encode queue": 10.0, "encode": 80.0,
        "embedding transfer": 2.0, "prefill queue": 7.0, "prefill": 140.0, "KV export": 6.0,
        "IPC hops": 29 / 3, "other": 0.0}, abs=1e-9)
    assert sum(t["mean"].values()) == pytest.approx((304 + 324 + 154) / 3)
    assert t["p95"]["encode queue"] == pytest.approx(5 + 0.9 * 20)  # of [0, 5, 25]
    # A colocated worker encodes in-process: the same stages, without a transfer.
    colo = RequestTrace.from_json({"request_id": "d", "path": "colocated", "ttft_ms": 200.0,
                                   "router_queue_ms": 1.0, "num_images": 2, "encode_queue_ms": 0.0,
                                   "encode_ms": 60.0, "embedding_bytes": 0, "queue_ms": 4.0,
                                   "prefill_ms": 130.0})
    c = server_trace.breakdown(client_result([0.2], [[]], ["d"]), [colo])["ttft"]
    assert c["parts"] == ["http", "router", "encode queue", "encode", "embedding transfer",
                          "queue", "prefill", "IPC hops", "other"]
    assert c["mean"]["encode"] == 60.0 and c["mean"]["other"] == pytest.approx(0.0, abs=1e-9)
    # An EPD trace without "path" is disaggregated, as pd is.
    assert RequestTrace.from_json({"request_id": "e", "mode": "epd"}).path == "disaggregated"
    md = report.breakdown_markdown([{"name": "1e1p1d", "breakdown": b}], "ttft")
    assert "| encode | 80.0 | 120.0 |" in md and "| embedding transfer | 2.0 | 3.0 |" in md
    from epdserve.bench import plots

    plots.plot_stages([{"name": "colocated", "breakdown": {"ttft": c}},
                       {"name": "1e1p1d", "breakdown": b}], tmp_path / "stages.png")
    assert (tmp_path / "stages.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_server_summary_and_table_with_and_without_image_keys(tmp_path):
    path = tmp_path / "t.jsonl"
    text = {"request_id": "t", "kv_bytes": 500, "kv_transfer_ms": 0.0, "prefill_ms": 50.0}
    rows = [epd_record("a"), epd_record("b", num_images=2, embedding_bytes=663552,
                                        embedding_fetch_ms=4.0, encode_ms=200.0), text]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = server_trace.summarize(path, ["a", "b", "t"])
    # Image keys: over the two requests with images; the text-only one is left out.
    assert s["mean_embedding_bytes"] == pytest.approx((331776 + 663552) / 2)
    assert s["mean_embedding_transfer_ms"] == pytest.approx(4.0)
    assert s["mean_num_images"] == pytest.approx(1.5) and s["mean_encode_ms"] == 160.0
    assert s["mean_embedding_bytes_per_image"] == pytest.approx(331776)
    assert s["mean_embedding_transfer_ms_per_image"] == pytest.approx((3.0 + 2.5) / 2)
    assert s["mean_kv_bytes"] == pytest.approx((2_000_000 + 500) / 3)  # every request
    path.write_text(json.dumps(text) + "\n")
    plain = server_trace.summarize(path, ["t"])
    assert plain["mean_kv_bytes"] == 500
    assert not [k for k in plain if "embedding" in k or "encode" in k or "images" in k]

    entries = [{"name": "colocated", "result": {"failed": 0}, "server": plain},
               {"name": "1e1p1d", "result": {"failed": 0}, "server": s}]
    by_label = {r[0]: r[1:] for r in report.table(entries)[1]}
    assert by_label["Embeddings per request (MB, mean)"] == ["lower", "—", "0.498", "—"]
    assert by_label["Embedding transfer per request (ms, mean)"] == ["lower", "—", "4.00", "—"]
    assert by_label["Embeddings per image (MB, mean)"] == ["lower", "—", "0.332", "—"]
    assert by_label["Encode per request (ms, mean)"] == ["lower", "—", "160.0", "—"]
    labels = [r[0] for r in report.table(entries)[1]]
    assert (labels.index("Embeddings per request (MB, mean)")
            == labels.index("KV transfer per request (ms, mean)") + 1)
    stages = report.server_table_markdown(entries)
    assert "| embedding_bytes | — | — | 497,664.0 |" in stages
    assert "Embedding" not in report.text_table(entries[:1])  # text-only runs: no rows


def entry_with_sweep(name, points):
    return {"name": name, "result": {}, "breakdown": {
        "ttft": {"n": 2, "parts": ["router", "prefill", "other"],
                 "mean": {"router": 3.0, "prefill": 300.0, "other": 20.0},
                 "p95": {"router": 5.0, "prefill": 500.0, "other": 40.0}},
        "handoff": None if name == "colocated" else {
            "n": 2, "parts": ["KV import", "other"], "mean": {"KV import": 9.0, "other": 90.0},
            "p95": {"KV import": 12.0, "other": 120.0}}},
        "sweep": {"max_rate": 1.0, "target_share": 0.9, "bracket": [1.0, 2.0], "points": [
            {"rate": r, "slo_attainment": a, "request_goodput": g, "request_throughput": r}
            for r, a, g in points]}}


def test_stacked_stage_and_goodput_plots_are_written(tmp_path):
    entries = [entry_with_sweep("colocated", [(0.5, 1.0, 0.5), (2.0, 0.5, 1.0)]),
               entry_with_sweep("pd", [(0.5, 1.0, 0.5), (1.0, 0.9, 0.9), (2.0, 0.2, 0.4)])]
    from epdserve.bench import plots

    plots.plot_stages(entries * 10, tmp_path / "many.png")  # colours never run out
    plots.plot_stages(entries, tmp_path / "stages.png")
    plots.plot_goodput_vs_rate(entries, tmp_path / "goodput_vs_rate.png")
    for png in ("stages.png", "goodput_vs_rate.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    md = report.sweep_markdown(entries)
    assert "- pd: max rate with 90% of requests within the SLOs: 1 req/s" in md
    assert "1: 90%" in md


def test_server_that_dies_gives_its_log_tail(tmp_path):
    dying = [sys.executable, "-c", "import sys; print('boom: unknown mode'); sys.exit(3)"]
    with pytest.raises(processes.ServerError, match="status 3") as info:
        compare.run_config("pd", [req(0.0, "x")], compare_args(free_port()), tmp_path,
                           serve=dying)
    assert info.value.log_tail == "boom: unknown mode"
    assert "\n" not in info.value.reason  # one line for the entry; the tail apart


def test_port_in_use_is_refused_before_starting(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(processes.ServerError, match=f"port {port}"):
            compare.run_config("colocated", [req(0.0, "x")], compare_args(port), tmp_path,
                               serve=STUB)


def test_stop_kills_the_whole_group_even_if_a_child_ignores_sigterm(tmp_path):
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(600)")
    cmd = ["sh", "-c", f"{sys.executable} -c \"{stubborn}\" & wait"]
    server = processes.ServerProcess("x", cmd, tmp_path / "x.log", "http://127.0.0.1:9")
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
        "import sys, argparse, signal\n"
        # A shell that starts a job in the background (CI may) leaves SIGINT ignored in
        # it, and Python keeps it so; a user's terminal delivers Ctrl-C.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from pathlib import Path\n"
        "from epdserve.bench import compare, workload\n"
        "p = argparse.ArgumentParser(); compare.add_arguments(p)\n"
        f"args = compare.config_from(compare.CompareOptions, p.parse_args(['--port', '{port}', '--disable-tqdm']))\n"
        "trace = [workload.Request(60.0, 'late', 4, 'chat', 1)]\n"
        f"compare.run_config('colocated', trace, args, Path({str(tmp_path)!r}),"
        f" serve={STUB!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "ready after" in line:
                break
        assert not processes.port_is_free(port)
        time.sleep(0.3)  # into the run
        proc.send_signal(signal.SIGINT)
        # Generous: stopping may wait out the server's 15 s SIGTERM grace on a loaded machine.
        proc.wait(timeout=60)
        assert proc.returncode != 0
        assert processes.port_is_free(port)
    finally:
        proc.kill()
        proc.wait()


def test_server_trace_summary_filters_to_this_runs_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"request_id": f"r{i}", "kv_bytes": 100 * i, "kv_transfer_ms": 0.0,
             "prefill_ms": 10.0, "queue_ms": 0.0} for i in range(1, 5)]
    # Malformed: not JSON, and JSON that is not a trace record (no request_id).
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n{\"prefill_ms\": 1.0}\n")
    s = server_trace.summarize(path, ["r1", "r2", "r3", None])
    assert s["num_records"] == 4 and s["matched_client_requests"] == 3
    assert s["malformed_lines"] == 2
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
    assert header == ["Metric", "Better", "colocated", "pd", "pd (x of colocated)"]
    by_label = {r[0]: r[1:] for r in rows}
    assert by_label["TTFT p50 (ms)"] == ["lower", "100.0", "150.0", "1.50x"]
    assert by_label["Failed requests"] == ["lower", "0", "2", "—"]
    assert by_label["KV per request (MB, mean)"] == ["lower", "0.00", "—", "—"]
    # no SLOs and no per-request arrays (a hand-made result): goodput unknown, row left out
    assert "Goodput (req/s within the SLOs)" not in by_label
    assert "TTFT p50 (ms)" in report.text_table(entries)


def test_compare_cli_bad_value_exits_2_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "epdserve", "compare", "--configs", "colocated,colocated"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "named twice" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["--configs", "colocated,0p1d"], "0p1d"),
    (["--port", "70000"], "70000"),
    (["--trace", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
    (["--sweep-rates", "2:1"], "2:1"),
    (["--goodput-target", "1.5"], "1.5"),
    (["--sweep-rates", "0.5:2"], "--goodput"),
    (["--startup-timeout", "0"], "--startup-timeout: '0'"),
    (["--endpoint", "/v1/embeddings"], "'/v1/embeddings': expected one of chat, completions, /v1/chat/completions"),
    (["--repeats", "0"], "--repeats: '0': expected a positive integer or 'auto'"),
    (["--repeats", "2", "--budget", "5"], "--budget is for --repeats auto, not --repeats 2"),
    (["--budget", "0"], "--budget: '0'"),
    (["--workload", "synthetic", "--num-prompts", "2", "--images-per-request", "1", "--endpoint", "completions"],
     "only the chat endpoint"),
])
def test_compare_cli_bad_values_exit_2(capsys, args, needle):
    """The command's own entry point, in-process (the subprocess test above covers the
    process): exit status 2 naming the bad value, before any server starts."""
    code, err = cli_exit(capsys, ["compare", *args])
    assert code == 2 and needle in err, err


def serve_flags(name: str) -> list[str] | None:
    """The serve flags of a configuration name, None for an unknown one."""
    try:
        return DeploymentSpec.parse(name).serve_flags()
    except ValueError:
        return None


def num_workers(name: str) -> int:
    return DeploymentSpec.parse(name).num_workers


def test_configuration_names_map_to_serve_flags():
    assert serve_flags("pd") == ["--mode", "pd"]
    assert serve_flags("colocated-2") == ["--mode", "colocated", "--workers", "2"]
    assert serve_flags("2p1d") == ["--mode", "pd", "--prefill-workers", "2", "--decode-workers", "1"]
    assert serve_flags("colocated-chunked") == ["--mode", "colocated", "--max-num-batched-tokens", "256"]
    assert serve_flags("2p1d-noprefix") == serve_flags("2p1d") + ["--no-enable-prefix-caching"]
    assert serve_flags("bogus") is None
    assert serve_flags("bogus-noprefix") is None
    assert [num_workers(n) for n in ("colocated", "colocated-chunked", "colocated-3",
                                     "pd", "2p3d", "colocated-2-noprefix")] == [1, 1, 3, 2, 5, 2]


def test_epd_names_map_to_serve_flags():
    assert serve_flags("2e1p1d") == ["--mode", "epd", "--encode-workers", "2",
                                     "--prefill-workers", "1", "--decode-workers", "1"]
    assert serve_flags("1e2p3d-noprefix") == serve_flags("1e2p3d") + [
        "--no-enable-prefix-caching"]
    assert serve_flags("0e1p1d") is None and serve_flags("1e1p") is None
    assert num_workers("2e1p1d") == 4 and num_workers("1e2p3d") == 6
    assert compare.parse_configs("colocated,pd,2e1p1d") == ["colocated", "pd", "2e1p1d"]
    with pytest.raises(Exception, match="1e1p1d"):
        compare.parse_configs("colocated,1e1q1d")
    cmd = compare.server_command("2e1p1d", 8100, Path("/t.jsonl"), "vlm", serve=["serve"])
    assert cmd == ["serve", *serve_flags("2e1p1d"), "--host", "127.0.0.1",
                   "--port", "8100", "--trace-file", "/t.jsonl", "--model", "vlm"]


def test_configs_name_the_bad_value_and_every_form():
    with pytest.raises(argparse.ArgumentTypeError) as info:
        compare.parse_configs("colocated,pd-local")
    assert "'pd-local'" in str(info.value) and "XeYpZd" in str(info.value)
    with pytest.raises(argparse.ArgumentTypeError, match="named twice"):
        compare.parse_configs("pd-local7,pd-local007")


def test_servers_get_the_multimodal_model_for_a_trace_with_images():
    text = [req(0.0, "a b")]
    images = text + [workload.Request(0.1, "look", 4, "chat", 1,
                                      images=({"width": 8, "height": 8, "seed": 0},))]
    assert compare.server_model(None, text) is None  # the default (text) model
    assert compare.server_model(None, images) == "vlm"
    assert compare.server_model("/m/smolvlm", images) == "/m/smolvlm"  # as given


def test_resources_taken_after_the_run_and_against_the_real_pd_server(pd_server, tmp_path):
    server = processes.ServerProcess("pd", [], tmp_path / "x.log", pd_server.url)
    server.proc = subprocess.Popen(["sleep", "30"])  # wait_healthy checks it is alive
    try:
        assert server.wait_healthy(30, workers=2) >= 0
        with pytest.raises(processes.ServerError, match="3 workers up"):
            server.wait_healthy(1, workers=3)  # 200, but only two are up
    finally:
        server.proc.kill()
        server.proc.wait()


def test_workload_description_of_a_trace():
    d = describe([req(0.0, "a b"), req(2.5, "c d e", kind="long")])
    assert d["num_requests"] == 2 and d["long"]["offsets_s"] == [2.5]
    assert bench_args().endpoint == "chat"


def test_repeats_run_interleaved_and_fold_into_one_entry_each(monkeypatch, tmp_path):
    """--repeats 3: A B A B A B, each deployment's runs folded by repeats.combine (median
    and range); a run that failed is listed, not averaged in."""
    order, goodput = [], {"colocated": iter([1.0, 3.0, 2.0]), "pd": iter([5.0, 4.0, None])}

    def fake_run(dep, requests, args, out_dir, progress=""):
        order.append((dep.name, progress))
        g = next(goodput[dep.name])
        if g is None:
            raise processes.ServerError("pd did not start")
        return {"name": dep.name, "mode": "colocated", "itl_stalls": 0,
                "result": {"completed": 4, "failed": 0, "request_goodput": g,
                           "slo_attainment": 1.0, "goodput_slos_ms": {"ttft": 1.0},
                           "ttfts": [], "itls": [], "e2els": [], "output_lens": [],
                           "errors": [], "duration": 1.0}}

    monkeypatch.setattr(compare, "run_config", fake_run)
    args = compare_args(free_port(), "--repeats", "3")
    chosen = [compare.from_config("colocated"), compare.from_config("pd")]
    entries, status, stopped = compare._run_all(chosen, [], args, tmp_path)
    assert stopped == "--repeats 3: 3 runs per configuration."
    assert order == [("colocated", "1/6"), ("pd", "2/6"), ("colocated", "3/6"), ("pd", "4/6"),
                     ("colocated", "5/6"), ("pd", "6/6")]
    assert status == 1  # one run failed
    a, b = entries
    assert a["result"]["request_goodput"] == 2.0 and a["spread"]["request_goodput"] == [1.0, 3.0]
    assert len(a["runs"]) == 3 and "failed_runs" not in a
    assert b["result"]["request_goodput"] == 4.5 and b["spread"]["request_goodput"] == [4.0, 5.0]
    assert b["failed_runs"] == ["pd did not start"]
