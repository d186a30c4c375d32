"""``elastic`` in ``epdserve compare``: the router trace's event lines (skipped
as request records, read as each worker's roles over time and the switches), the SLOs an
elastic deployment is started with, the roles panel under the ITL-over-time plot, the
report's switch lines, and benchmarks/elastic.py's arithmetic and output on canned compare
results.

The end-to-end run uses the stub server of ``test_bench_client.py`` behind a wrapper (this
file run as a script): it records the serve options it got and appends the router's
``role`` and ``elastic_decision`` lines (the router's contract with compare) while the trace runs:
the two workers start colocated, and after the first measured request the controller
splits them into a prefill and a decode worker. The live role switch itself is the
router's, tested with it.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from epdserve.argtypes import config_from
from epdserve.bench import compare, metrics, plots, processes, report, server_trace
from scripts import load_script

pytestmark = pytest.mark.elastic

HERE = Path(__file__).resolve().parent
ELASTIC_STUB = [sys.executable, str(Path(__file__).resolve())]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def write_lines(path: Path, objs: list) -> None:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))


def role(at, worker, role_, state, previous=None, drain_ms=None, reason=None) -> dict:
    return {"event": "role", "at": at, "worker": worker, "role": role_, "previous": previous,
            "state": state, "drain_ms": drain_ms, "reason": reason}


REQUEST = {"request_id": "cmpl-1", "mode": "colocated", "prompt_tokens": 10, "output_tokens": 4,
           "max_tokens": 4, "finish_reason": "length", "queue_ms": 1.0, "prefill_ms": 5.0,
           "decode_ms": 9.0, "e2e_ms": 15.0, "kv_bytes": 0, "kv_transfer_ms": 0.0}


# ----------------------------------------------------------------- trace event lines


def test_event_lines_are_neither_records_nor_malformed(tmp_path):
    path = tmp_path / "t.jsonl"
    write_lines(path, [role(100.0, "w0", "colocated", "up"), REQUEST,
                       {"event": "elastic_sample", "at": 101.0, "sample": {"t": 1.0}},
                       "not json", [1, 2], {**REQUEST, "request_id": "cmpl-2"}])
    records, bad = server_trace.read(path)
    assert [r.request_id for r in records] == ["cmpl-1", "cmpl-2"]
    assert bad == 2  # the line that is not JSON and the one that is not an object
    summary = server_trace.summarize(path, ["cmpl-1", "cmpl-2"])
    assert (summary["num_records"], summary["matched_client_requests"], summary["malformed_lines"]) == (2, 2, 2)
    assert [e["at"] for e in server_trace.events(path, "elastic_sample")] == [101.0]


def test_role_timeline_intervals_switches_and_decisions(tmp_path):
    path = tmp_path / "t.jsonl"
    write_lines(path, [
        role(100.0, "w0", "colocated", "up"), role(100.5, "w1", "colocated", "up"), REQUEST,
        {"event": "elastic_decision", "at": 110.0, "action": "to-pd", "roles": {"w0": "prefill", "w1": "decode"},
         "reason": "prefill queue p90 4200 ms > 3000 ms", "signals": {"prefill_queue_p90_ms": 4200.0}},
        role(110.0, "w0", "prefill", "switching", "colocated", reason="to-pd"),
        role(110.0, "w1", "decode", "switching", "colocated", reason="to-pd"),
        role(110.3, "w0", "prefill", "switched", "colocated", drain_ms=300.0),
        role(111.0, "w1", "decode", "switched", "colocated", drain_ms=1000.0),
        role(115.0, "w1", "colocated", "switching", "decode"),  # not done by the end
        role(116.0, "w2", "sleeping", "up"),  # an unknown role: not drawn
        role("soon", "w0", "decode", "switching"),  # no time: skipped
    ])
    out = server_trace.role_timeline(path, end_unix=120.0)
    assert out["workers"] == {
        "w0": [[100.0, 110.0, "colocated", "active"], [110.0, 110.3, "prefill", "draining"],
               [110.3, 120.0, "prefill", "active"]],
        "w1": [[100.5, 110.0, "colocated", "active"], [110.0, 111.0, "decode", "draining"],
               [111.0, 115.0, "decode", "active"], [115.0, 120.0, "colocated", "draining"]]}
    sw = out["switches"]
    assert (sw["count"], sw["requested"]) == (2, 3)
    assert (sw["drain_ms_p50"], sw["drain_ms_max"]) == (650.0, 1000.0)
    assert sw["decisions"] == [{"at": 110.0, "action": "to-pd", "reason": "prefill queue p90 4200 ms > 3000 ms",
                                "roles": {"w0": "prefill", "w1": "decode"}}]
    # Without an end: the last interval ends at the last event.
    assert server_trace.role_timeline(path)["workers"]["w0"][-1] == [110.3, 116.0, "prefill", "active"]


def test_a_static_trace_has_no_timeline(tmp_path):
    path = tmp_path / "t.jsonl"
    write_lines(path, [REQUEST])
    assert server_trace.role_timeline(path) == {"workers": {}, "switches": {}}
    assert server_trace.role_timeline(tmp_path / "absent.jsonl") == {"workers": {}, "switches": {}}
    assert report.role_switch_lines({"name": "colocated-2", "role_switches": {}}) == []


# ------------------------------------------------------------------ serve's --slo


def test_elastic_gets_the_goodput_slos_or_the_default_ones():
    cmd = processes.server_command("elastic", 8100, Path("/t.jsonl"), None, serve=["serve"],
                                   slos_ms={"ttft": 10000.0, "tpot": 250.5})
    assert cmd[:10] == ["serve", "--elastic", "--mode", "colocated", "--workers", "2",
                        "--slo", "ttft:10000", "tpot:250.5", "--host"]
    cmd = processes.server_command("elastic-3-noprefix", 8100, Path("/t.jsonl"), None, serve=["serve"])
    default = [f"{k}:{v:g}" for k, v in metrics.DEFAULT_SLOS_MS.items() if k in ("ttft", "tpot")]
    assert cmd[cmd.index("--slo") + 1:cmd.index("--host")] == default  # what compare judges by (steered ones)
    only_itl = processes.server_command("elastic", 8100, Path("/t.jsonl"), None, serve=["serve"],
                                        slos_ms={"itl": 1000.0})
    assert "--slo" not in only_itl  # nothing the controller steers by: serve's defaults
    assert ["--workers", "3"] == cmd[4:6] and "--no-enable-prefix-caching" in cmd
    for static in ("colocated-2", "1p1d"):  # the SLOs are elastic's only
        assert "--slo" not in processes.server_command(static, 8100, Path("/t.jsonl"), None, serve=["serve"],
                                                       slos_ms={"ttft": 1.0})
    args = compare_args("--goodput", "ttft:3000", "itl:1000")
    assert args.slos == {"ttft": 3000.0, "itl": 1000.0}
    assert compare_args().slos is None


# ------------------------------------------------------- end to end with the stub


def compare_args(*extra: str) -> compare.CompareOptions:
    from test_bench_compare import free_port

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return config_from(compare.CompareOptions, parser.parse_args(
        ["--port", str(free_port()), "--disable-tqdm", "--startup-timeout", "30", "--repeats", "1", *extra]))


def test_elastic_entry_end_to_end_against_the_stub(tmp_path):
    from test_bench_client import req

    trace = [req(0.0, "one two"), req(0.05, "three"), req(0.1, "a long one", kind="long"), req(0.3, "four")]
    args = compare_args("--goodput", "ttft:10000", "tpot:300")
    e = compare.run_config("elastic", trace, args, tmp_path, serve=ELASTIC_STUB)
    argv = json.loads((tmp_path / "elastic.server.jsonl.argv").read_text())
    assert argv[:9] == ["--elastic", "--mode", "colocated", "--workers", "2", "--slo", "ttft:10000", "tpot:300",
                        "--host"]
    r = e["result"]
    assert (r["completed"], r["failed"]) == (4, 0)
    assert e["server"]["num_records"] == 5 and "malformed_lines" not in e["server"]  # warm-up + 4
    start, end = e["run_start_unix"], e["run_end_unix"]
    assert start < end
    lanes = e["roles_timeline"]
    assert sorted(lanes) == ["w0", "w1"]
    assert [iv[2:] for iv in lanes["w0"]] == [["colocated", "active"], ["prefill", "draining"], ["prefill", "active"]]
    assert [iv[2:] for iv in lanes["w1"]] == [["colocated", "active"], ["decode", "draining"], ["decode", "active"]]
    switched_at = lanes["w0"][1][0]
    assert start < switched_at < end  # the stub switched during the measured run
    assert lanes["w0"][-1][1] == end  # the last interval lasts to the run's end
    sw = e["role_switches"]
    assert (sw["count"], sw["requested"], sw["drain_ms_p50"], sw["drain_ms_max"]) == (2, 2, 200.0, 250.0)
    assert [d["action"] for d in sw["decisions"]] == ["to-pd"]

    static = {**e, "name": "colocated-2", "roles_timeline": {}, "role_switches": {}}
    compare.write_outputs([static], trace, {"source": "test"}, tmp_path / "static")
    compare.write_outputs([static, e], trace, {"source": "test"}, tmp_path)
    md = (tmp_path / "compare.md").read_text()
    assert "- role switches: 2 done (2 asked), drain p50 200 ms, max 250 ms" in md
    assert f"  - {switched_at - start:+.1f} s: to-pd — prefill queue p90 4200 ms > SLO" in md
    assert md.count("- role switches:") == 1  # the static entry has none
    saved = json.loads((tmp_path / "compare.json").read_text())["configs"][1]
    assert saved["roles_timeline"] == lanes and saved["role_switches"] == sw
    # The roles panel under the ITL plot: the same width, taller.
    (w0, h0), (w1, h1) = png_size(tmp_path / "static" / "itl_over_time.png"), png_size(tmp_path / "itl_over_time.png")
    assert w1 == w0 and h1 > h0


def test_roles_panel_shares_the_itl_plots_time_origin(tmp_path):
    result = {"errors": ["", ""], "ttfts": [0.5, 0.5], "itls": [[0.1, 0.1], [0.2]], "start_offsets": [0.0, 10.0]}
    entry = {"name": "elastic", "result": result, "run_start_unix": 1000.0,
             "roles_timeline": {"w0": [[995.0, 1004.0, "colocated", "active"], [1004.0, 1006.0, "prefill", "draining"],
                                       [1006.0, 1020.0, "prefill", "active"]]}}
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    plots.plot_roles(ax, entry["roles_timeline"], entry["run_start_unix"], "elastic")
    spans = [(round(c.get_paths()[0].get_extents().x0, 6), round(c.get_paths()[0].get_extents().x1, 6), c.get_hatch())
             for c in ax.collections]
    plt.close(fig)
    assert spans == [(-5.0, 4.0, None), (4.0, 6.0, "///"), (6.0, 20.0, None)]  # seconds since the run's start
    plots.plot_itl_over_time([entry], [10.0], tmp_path / "itl.png")
    assert png_size(tmp_path / "itl.png")[1] > 495  # 4.5 in at 110 dpi, and the panel


def test_itl_plot_marks_each_phase_of_a_shifting_workload(tmp_path, monkeypatch):
    result = {"errors": [""], "ttfts": [0.5], "itls": [[0.1, 0.1]], "start_offsets": [0.0]}
    drawn = []
    monkeypatch.setattr(plots.plt, "close", drawn.append)  # keep the figure to read it back
    plots.plot_itl_over_time([{"name": "colocated", "result": result}], [], tmp_path / "itl.png", [0.0, 40.5, 90.0])
    ax = drawn[0].axes[0]
    dash_dot = [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "-."]
    assert dash_dot == [0.0, 40.5, 90.0]
    assert [t.get_text() for t in ax.texts] == ["phase 1", "phase 2", "phase 3"]
    assert "phase starts" in [t.get_text() for t in ax.get_legend().get_texts()]


# --------------------------------------------------------------- the benchmark


@pytest.fixture(scope="module")
def bench_script():
    return load_script("elastic")


def entry(name: str, goodput: float, cores: int = 2) -> dict:
    return {"name": name, "result": {"request_goodput": goodput, "slo_attainment": goodput / 0.5,
                                     "goodput_slos_ms": {"ttft": 10000.0, "tpot": 250.0}},
            "resources": {"num_cores": cores, "device_kind": "core"}}


def canned(tmp_path: Path, workload: str, entries: list[dict]) -> None:
    (tmp_path / workload).mkdir(parents=True)
    (tmp_path / workload / "compare.json").write_text(json.dumps({"configs": entries}))


def test_benchmark_ratios_and_outputs_from_canned_compare_runs(bench_script, tmp_path, capsys):
    canned(tmp_path, "shift", [entry("colocated", 0.10), entry("colocated-2", 0.12), entry("1p1d", 0.08),
                               entry("elastic", 0.18)])
    canned(tmp_path, "demo", [entry("colocated", 0.20), entry("colocated-2", 0.19),
                              {"name": "1p1d", "mode": "pd", "error": "server exited with status 1"},
                              entry("elastic", 0.18)])
    assert bench_script.main(["--output", str(tmp_path), "--from-existing"]) == 0
    out = json.loads((tmp_path / "elastic.json").read_text())
    assert out["slos_ms"] == {"ttft": 10000.0, "tpot": 60.0} and out["configs"] == bench_script.parse_configs(
        "colocated,colocated-2,1p1d,elastic")
    shift, demo = out["workloads"]["shift"], out["workloads"]["demo"]
    assert shift["configs"]["colocated-2"]["goodput_per_core"] == pytest.approx(0.06)
    assert (shift["best_static"], shift["elastic"]) == ("colocated-2", "elastic")
    assert shift["elastic_over_best_static"] == pytest.approx(1.5) and shift["meets_goal"] is True
    assert demo["best_static"] == "colocated" and demo["configs"]["1p1d"] == {"error": "server exited with status 1"}
    assert demo["elastic_over_best_static"] == pytest.approx(0.9) and demo["meets_goal"] is False
    printed = capsys.readouterr().out
    assert "elastic / best static (colocated-2): 1.50x (meets the goal); goal >= 1.2x" in printed
    assert "elastic / best static (colocated): 0.90x (misses the goal); goal >= 0.95x" in printed
    assert "colocated-2      goodput 0.1200 req/s on 2 cores = 0.0600 req/s per core" in printed
    assert "SLOs: ttft:10000 ms, tpot:60 ms" in printed
    assert png_size(tmp_path / "elastic.png")[0] > 0


def test_benchmark_without_elastic_or_a_run_says_so(bench_script, tmp_path, capsys):
    canned(tmp_path, "demo", [entry("colocated", 0.2), entry("1p1d", 0.0)])
    assert bench_script.main(["--output", str(tmp_path), "--from-existing", "--workloads", "demo",
                              "--configs", "colocated,1p1d"]) == 0
    demo = json.loads((tmp_path / "elastic.json").read_text())["workloads"]["demo"]
    assert demo["elastic"] is None and demo["elastic_over_best_static"] is None and demo["meets_goal"] is None
    assert "elastic / best static (colocated): —" in capsys.readouterr().out
    assert bench_script.main(["--output", str(tmp_path / "none"), "--from-existing"]) == 1


def test_benchmark_command_and_bad_options(bench_script, capsys):
    from epdserve.bench.datasets import parse_phases

    args = bench_script.parse_args(["--seed", "3", "--shift-phases", "in=10:20,out=5,rate=1,n=2"])
    cmd = bench_script.compare_command(args, "shift", Path("out/shift"))
    assert cmd[:4] == [sys.executable, "-m", "epdserve", "compare"]
    assert cmd[4:] == ["--workload", "shift", "--configs", "colocated,colocated-2,1p1d,elastic",
                       "--goodput", "ttft:10000", "tpot:60", "--seed", "3", "--repeats", "1", "--output", "out/shift",
                       "--shift-phases", "in=10:20,out=5:5,rate=1,n=2"]
    assert args.shift_phases == parse_phases("in=10:20,out=5,rate=1,n=2")
    assert "--shift-phases" not in bench_script.compare_command(args, "demo", Path("d"))
    assert bench_script.parse_args([]).shift_phases == parse_phases(bench_script.PHASES)
    for bad, needle in ((["--workloads", "shift,burst"], "'shift,burst': expected"),
                        (["--configs", "elastic-1"], "elastic-1")):
        with pytest.raises(SystemExit) as info:
            bench_script.parse_args(bad)
        assert info.value.code == 2 and needle in capsys.readouterr().err


# ------------------------------------------------- the stub wrapper (run as a script)


def _announce_switches(trace_file: Path) -> None:
    """The router's lines of one split: both workers up at once; after the first measured
    request (the second line: the warm-up's is the first) the controller's decision and
    both switches asked; after the next, both done (drains 150 and 250 ms)."""
    def append(*objs: dict) -> None:
        with open(trace_file, "a") as f:
            f.write("".join(json.dumps(o) + "\n" for o in objs))

    def requests() -> int:
        lines = trace_file.read_text().splitlines() if trace_file.exists() else []
        return sum("event" not in json.loads(x) for x in lines)

    now = time.time()
    append(role(now, "w0", "colocated", "up"), role(now, "w1", "colocated", "up"))
    deadline = now + 60  # the test's run is over long before
    while requests() < 2 and time.time() < deadline:
        time.sleep(0.01)
    now = time.time()
    append({"event": "elastic_decision", "at": now, "action": "to-pd", "roles": {"w0": "prefill", "w1": "decode"},
            "reason": "prefill queue p90 4200 ms > SLO", "signals": {"prefill_queue_p90_ms": 4200.0}},
           role(now, "w0", "prefill", "switching", "colocated", reason="to-pd"),
           role(now, "w1", "decode", "switching", "colocated", reason="to-pd"))
    while requests() < 3 and time.time() < deadline:
        time.sleep(0.01)
    now = time.time()
    append(role(now, "w0", "prefill", "switched", "colocated", drain_ms=150.0),
           role(now, "w1", "decode", "switched", "colocated", drain_ms=250.0))


def elastic_stub() -> None:
    """Take ``epdserve serve --elastic --workers N --slo ...``, write the options to
    TRACE_FILE.argv, announce the switches into the trace, serve as the stub."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--elastic", action="store_true")
    parser.add_argument("--workers")
    parser.add_argument("--slo", nargs="+")
    parser.add_argument("--trace-file", required=True)
    _, rest = parser.parse_known_args()
    trace_file = Path(parser.parse_known_args()[0].trace_file)
    Path(f"{trace_file}.argv").write_text(json.dumps(sys.argv[1:]))
    threading.Thread(target=_announce_switches, args=(trace_file,), daemon=True).start()
    sys.path.insert(0, str(HERE))
    import test_bench_client

    sys.argv = [sys.argv[0], *rest, "--trace-file", str(trace_file)]
    test_bench_client.serve_stub()


if __name__ == "__main__":
    elastic_stub()


def test_oracle_ceiling_of_any_switching_policy(bench_script):
    """Two phases of 2 requests: colocated serves phase 1 within the SLOs, 1p1d phase 2;
    each static one gets 2 of 4, an oracle switching for free 4: a ceiling of 2.0x. The
    elastic entry and a failed request do not count; no phases, no ceiling."""
    def result(ok: list[bool]) -> dict:
        return {"errors": ["" if o else "boom" for o in ok], "ttfts": [0.5 if o else None for o in ok],
                "latencies": [0.7] * len(ok), "output_lens": [6] * len(ok), "itls": [[0.04] * 5] * len(ok)}
    compare = {"trace": {"phase_windows": {"first": [0, 2], "n": [2, 2]}},
               "configs": [{"name": "colocated", "result": result([True, True, False, False])},
                           {"name": "1p1d", "result": result([False, False, True, True])},
                           {"name": "elastic", "result": result([True] * 4)}]}
    o = bench_script.oracle(compare)
    assert o == {"per_phase": {"colocated": [2, 0], "1p1d": [0, 2]}, "oracle": 4, "best_static": 2, "ceiling": 2.0}
    slow = dict(result([True] * 4), latencies=[60.0] * 4)  # TPOT (60 - 0.5) / 5 s: over 60 ms
    assert bench_script.oracle({**compare, "configs": [{"name": "colocated", "result": slow}]})["oracle"] == 0
    assert bench_script.oracle({"configs": compare["configs"]}) is None
