"""One measurement, every SLO: saved per-request outcomes judged again (bench/rejudge.py), the
map of who wins at which TTFT and gap SLOs (bench/slo_map.py) and ``epdserve report``
(bench/saved_report.py) on a saved comparison, its bad input refused before anything is
written.

The comparison is made in-process from client records: 40 requests, 2 runs a deployment,
2 cores each. colocated answers every request in 300 ms but 16 of them stall 700 ms once
(a long prompt's step); pd answers in 900 ms with no stall. So colocated wins where TTFT
is tight, pd where gaps are strict and TTFT relaxed, and both meet loose SLOs (a tie)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from epdserve.bench import compare, metrics, recommend, rejudge, repeats, slo_map
from epdserve.bench.client import RequestRecord
from epdserve.bench.traces import Request

N, STALLED = 40, 16


def records(ttft_s: float, stall_s: float | None) -> list[RequestRecord]:
    out = []
    for i in range(N):
        gaps = [0.05] * 10
        if stall_s is not None and i % 5 in (1, 3):  # 16 of 40
            gaps[4] = stall_s
        chunks = [ttft_s + sum(gaps[:k]) for k in range(len(gaps) + 1)]
        start = 0.5 * i
        out.append(RequestRecord(index=i, start_s=start, chunk_times_s=chunks, last_chunk_s=chunks[-1],
                                 end_s=start + chunks[-1], usage_completion_tokens=11, success=True,
                                 generated_text="x" * 11, max_tokens=11))
    return out


def entry(name: str, mode: str, ttft_s: float, stall_s: float | None, runs: int = 2) -> dict:
    result = metrics.compute(records(ttft_s, stall_s))
    resources = {"workers": [], "cores": [0, 1], "num_cores": 2, "device_kind": "core", "num_devices": 2,
                 "price_per_hour": None}
    return repeats.combine([{"name": name, "mode": mode, "result": result, "resources": resources,
                             "itl_stalls": 0, "server": {}} for _ in range(runs)])


@pytest.fixture
def entries() -> list[dict]:
    return [entry("colocated", "colocated", 0.3, 0.7), entry("pd", "pd", 0.9, None)]


def test_outcomes_keep_every_slos_value(entries):
    run = entries[0]["per_run"][0]
    assert set(paired_values := slo_map.paired.SLO_VALUES.values()) <= set(run)
    assert all(len(run[k]) == N for k in paired_values)
    assert run["max_itl_ms"][1] == pytest.approx(700) and run["max_itl_ms"][0] == pytest.approx(50)
    assert run["tpot_ms"][0] == pytest.approx(50) and run["ttft_ms"][0] == pytest.approx(300)


def test_judged_with_its_own_slos_the_verdict_is_comparess(entries):
    was = recommend.recommend(entries)
    again = recommend.recommend(rejudge.judge(entries, was["slos_ms"], default=was["slos_default"]))
    for key in ("choice", "verdict", "headline", "slos", "cannot_tell_apart"):
        assert again[key] == was[key], key


def test_the_map_shows_each_side_where_it_wins(entries):
    m = slo_map.slo_map(entries, dict(metrics.DEFAULT_SLOS_MS), {"ttft": [500, 2000], "itl": [500, 1000]})
    (tight_strict, tight_loose), (relaxed_strict, relaxed_loose) = m["cells"]
    assert (tight_loose["winner"], tight_loose["verdict"]) == ("colocated", "better")
    assert (relaxed_strict["winner"], relaxed_strict["verdict"]) == ("pd", "better")
    assert relaxed_strict["relative"] == pytest.approx(N / (N - STALLED) - 1)
    assert relaxed_strict["attainment"] == {"colocated": pytest.approx(0.6), "pd": 1.0}
    assert (relaxed_loose["winner"], relaxed_loose["verdict"]) == ("colocated", "tie")  # the simpler of a tie
    assert tight_strict["verdict"] == "better" and tight_strict["winner"] == "colocated"  # 60 % against 0
    assert slo_map.describe(relaxed_loose) == "tie: colocated"
    assert slo_map.describe(relaxed_strict).startswith("pd +67 % (CI ")
    table = slo_map.markdown(m)
    assert table.splitlines()[0] == "| TTFT \\ longest gap | ≤ 500 ms | ≤ 1,000 ms |"
    where = slo_map.region(m, dict(metrics.DEFAULT_SLOS_MS)).split("; ")
    assert where[0] == "at TTFT ≤ 2,000 ms and gaps ≤ 1,000 ms: tie: colocated"
    assert where[1] == "colocated (100% vs 0% within) at TTFT ≤ 500 ms and gaps ≤ 1,000 ms"
    assert where[2].startswith("pd +67 %") and where[2].endswith("at TTFT ≤ 2,000 ms and gaps ≤ 500 ms")


def test_the_default_grid_spans_a_quarter_to_four_times_the_slos():
    axes = slo_map.grid({"ttft": 2000.0, "tpot": 200.0})
    assert axes == {"ttft": [500, 1000, 2000, 4000, 8000], "itl": [250, 500, 1000, 2000, 4000]}
    assert slo_map.grid({"ttft": 2000.0}, [("itl", [100.0])])["itl"] == [100.0]


@pytest.mark.parametrize("text, words", [
    ("tpot:100", "KEY one of ttft, itl"), ("ttft:a,b", "not a comma list"), ("ttft:0,100", "above 0 ms"),
    ("itl:5,5", "distinct"), ("itl:" + ",".join(map(str, range(1, 11))), "1 to 8"),
])
def test_a_bad_grid_names_the_value(text, words):
    with pytest.raises(argparse.ArgumentTypeError, match=words):
        slo_map.parse_axis(text)


def test_older_outcomes_and_bad_slos_are_refused(entries):
    old = [{**e, "per_run": [{k: v for k, v in r.items() if k != "tpot_ms"} for r in e["per_run"]]} for e in entries]
    with pytest.raises(rejudge.SavedRunError, match="keeps no per-request tpot_ms"):
        rejudge.judge(old, {"tpot": 100.0})
    assert rejudge.judge(old, {"ttft": 500.0})[0]["result"]["slo_attainment"] == 1.0  # what it keeps still judges
    with pytest.raises(rejudge.SavedRunError, match="no per-request outcomes"):
        rejudge.judge([{**entries[0], "per_run": None}], {"ttft": 500.0})
    with pytest.raises(ValueError, match="ttft:0: an SLO must be above 0 ms"):
        rejudge.judge(entries, {"ttft": 0.0})


def save(entries: list[dict], directory, seed: int = 0) -> None:
    trace = [Request(0.5 * i, f"prompt {i} {seed}", 11, "chat", 5) for i in range(N)]
    compare.write_outputs(entries, trace, {"source": "test"}, directory, {"temperature": 0.0})


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve", "report", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_report_judges_a_saved_run_again_for_each_slo(entries, tmp_path):
    save(entries, tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "compare.json").read_text())
    assert saved["version"] == compare.VERSION and saved["slo_map"]["axes"]["ttft"][2] == 2000
    assert "## Who wins at which SLOs" in (tmp_path / "run" / "compare.md").read_text()
    assert saved["recommendation"]["region"].startswith("at TTFT ≤ 2,000 ms and gaps ≤ 1,000 ms: tie: colocated; ")
    tight = report(tmp_path / "run", "--goodput", "ttft:500", "itl:1000", "--output", tmp_path / "tight")
    strict = report(tmp_path / "run", "--goodput", "ttft:2000", "itl:500", "--slo-grid", "ttft:500,2000",
                    "itl:500,1000", "--output", tmp_path / "strict")
    assert tight.returncode == 0 and strict.returncode == 0, tight.stderr + strict.stderr
    assert json.loads((tmp_path / "tight" / "compare.json").read_text())["recommendation"]["choice"] == "colocated"
    got = json.loads((tmp_path / "strict" / "compare.json").read_text())
    assert got["recommendation"]["choice"] == "pd" and got["recommendation"]["verdict"] == "better"
    assert got["slo_map"]["axes"] == {"ttft": [500.0, 2000.0], "itl": [500.0, 1000.0]}
    assert "Use pd" in strict.stdout and (tmp_path / "strict" / "compare.md").exists()
    same = report(tmp_path / "run")  # the run's own SLOs: compare's verdict, in run/report
    assert same.returncode == 0, same.stderr
    again = json.loads((tmp_path / "run" / "report" / "compare.json").read_text())["recommendation"]
    assert again["headline"] == saved["recommendation"]["headline"]


def test_report_pools_runs_of_one_trace_and_refuses_bad_input(entries, tmp_path):
    save(entries, tmp_path / "a")
    save(entries, tmp_path / "b")
    pooled = report(tmp_path / "a", tmp_path / "b", "--output", tmp_path / "both")
    assert pooled.returncode == 0, pooled.stderr
    got = json.loads((tmp_path / "both" / "compare.json").read_text())
    assert [len(e["per_run"]) for e in got["configs"]] == [4, 4] and got["recommendation"]["runs"] == 4
    save(entries, tmp_path / "other", seed=1)
    (tmp_path / "old").mkdir()
    old = json.loads((tmp_path / "a" / "compare.json").read_text())
    del old["version"]  # compare.json before the layout was versioned
    (tmp_path / "old" / "compare.json").write_text(json.dumps(old))
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "compare.json").write_text((tmp_path / "a" / "compare.json").read_text())
    (tmp_path / "edited" / "trace.jsonl").write_text((tmp_path / "other" / "trace.jsonl").read_text())
    (tmp_path / "twins").mkdir()
    twins = json.loads((tmp_path / "a" / "compare.json").read_text())
    twins["configs"][1]["name"] = "colocated"
    (tmp_path / "twins" / "compare.json").write_text(json.dumps(twins))
    (tmp_path / "twins" / "trace.jsonl").write_text((tmp_path / "a" / "trace.jsonl").read_text())
    (tmp_path / "a-file").write_text("")
    cases = [((tmp_path / "a", tmp_path / "other"), "another trace than"),
             ((tmp_path / "edited",), "not the trace compare ran"),
             ((tmp_path / "twins",), "configuration names repeat"),
             ((tmp_path / "a", tmp_path / "a"), "given twice (its runs would count twice)"),
             ((tmp_path / "a", "--slo-grid", "ttft:500", "ttft:900"), "--slo-grid: ttft given twice"),
             ((tmp_path / "a", "--slo-grid", "itl:inf"), "a finite number above 0 ms"),
             ((tmp_path / "a", "--goodput", "ttft:500", "ttft:900"), "--goodput: ttft given twice"),
             ((tmp_path / "nothing",), "not a saved comparison"),
             ((tmp_path / "old",), "saved by an older epdserve"),
             ((tmp_path / "a", "--goodput", "ttft:0"), "ttft:0: an SLO must be above 0 ms"),
             ((tmp_path / "a", "--slo-grid", "gap:100"), "argument --slo-grid: 'gap:100': expected KEY:MS,MS")]
    got = report(tmp_path / "a", "--output", tmp_path / "a-file")
    assert got.returncode == 2 and "not a directory" in got.stderr
    for args, words in cases:
        got = report(*args, "--output", tmp_path / "refused")
        lines = [x for x in got.stderr.strip().splitlines() if x.startswith("epdserve report: error: ")]
        assert got.returncode == 2 and len(lines) == 1 and words in lines[0], (args, got.stderr)
    assert not (tmp_path / "refused").exists()  # nothing written half-way
