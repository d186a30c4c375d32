"""The plan's goodput question (plan/at_rate.py): deployments simulated at the trace's own
arrivals, judged and mapped as compare judges a measured run, and a predicted map laid
beside a measured one.

The in-process trace: a chat request every 0.5 s that decodes 200 tokens, and a 1,500-token
prompt every 3 s, on a platform that prefills 1 ms a token in steps of 10 ms. The colocated
worker (2 devices) prefills the long prompts in steps of its budget (~0.5 s) between the chats' tokens; the
split keeps decoding on its own device and prefills the long prompts on the other."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epdserve.bench import compare, slo_map
from epdserve.bench.traces import Request, save_trace
from epdserve.plan import at_rate
from epdserve.plan.costmodel import LinearStep, Link, Platform
from epdserve.plan.simulate import Deployment, EngineLimits, WorkerSpec

pytestmark = pytest.mark.plan

COLOCATED = Deployment("colocated", (WorkerSpec("colocated", 2),))
PD = Deployment("pd", (WorkerSpec("prefill"), WorkerSpec("decode")))
PLATFORM = Platform("tokens", step=lambda n: LinearStep((10.0 / n, 0.0, 1.0 / n, 0.0, 0.0)), worker_sizes=(1, 2),
                    kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0, router_ms=2.0)


def trace() -> list[Request]:
    chats = [Request(0.5 * i, "", 200, "chat", 20) for i in range(40)]
    longs = [Request(3.0 * i + 0.25, "", 2, "long", 1500) for i in range(7)]
    return sorted(chats + longs, key=lambda r: r.offset_s)


def test_the_goodput_question_maps_both_sides(tmp_path):
    deployments = [(COLOCATED, EngineLimits()), (PD, EngineLimits())]
    slos = {"ttft": 2000.0, "itl": 1000.0}
    text, written = at_rate.plan(deployments, PLATFORM, trace(), slos, "core", None, tmp_path, "test trace", 2)
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["question"] == "goodput" and {r["name"] for r in doc["rows"]} == {"colocated", "pd"}
    assert all(r["devices"] == 2 for r in doc["rows"])
    m = doc["slo_map"]
    assert m["axes"] == {"ttft": [500.0, 1000.0, 2000.0, 4000.0, 8000.0], "itl": [250.0, 500.0, 1000.0, 2000.0,
                                                                                   4000.0]}
    winners = {(c["slos_ms"]["ttft"], c["slos_ms"]["itl"]): (c["verdict"], c["winner"]) for row in m["cells"]
               for c in row}
    # Strict gaps: the colocated steps of ~0.5 s of prefill break them.
    assert winners[(8000.0, 250.0)] == ("better", "pd")
    assert "**At these SLOs:" in text and "Who wins at which SLOs" in text
    assert {p.name for p in written} == {"plan.md", "plan.json", slo_map.PNG}


def test_predicted_and_measured_maps_are_compared_cell_by_cell():
    deployments = [(COLOCATED, EngineLimits()), (PD, EngineLimits())]
    entries = [at_rate.entry(d, PLATFORM, trace(), limits, {}, "core") for d, limits in deployments]
    axes = slo_map.grid({"ttft": 2000.0, "itl": 1000.0})
    m = slo_map.slo_map(entries, {"ttft": 2000.0, "itl": 1000.0}, axes)
    same = at_rate.agreement(m, m)
    shown = sum(c["verdict"] == "better" for row in m["cells"] for c in row)
    assert same == {"same": shown, "opposite": 0, "predicted_only": 0, "measured_only": 0,
                    "neither": 25 - shown, "cells": 25}
    flipped = json.loads(json.dumps(m))
    for row in flipped["cells"]:
        for c in row:
            c["winner"] = {"pd": "colocated", "colocated": "pd"}.get(c["winner"])
    assert at_rate.agreement(flipped, m)["opposite"] == shown
    with pytest.raises(ValueError, match="different SLO grids"):
        at_rate.agreement({**m, "axes": {"ttft": [1.0], "itl": [1.0]}}, m)


def test_validate_lays_the_predicted_map_beside_the_measured_one(tmp_path):
    # "Measured": the same simulations saved as a compare run of the trace.
    deployments = [(COLOCATED, EngineLimits()), (PD, EngineLimits())]
    measured = [{**at_rate.entry(d, PLATFORM, trace(), limits, {}, "core"), "itl_stalls": 0, "server": {}}
                for d, limits in deployments]
    compare.write_outputs(measured, trace(), {"source": "test"}, tmp_path / "run", {"temperature": 0.0})
    predicted = [at_rate.entry(d, PLATFORM, trace(), limits, {}, "core") for d, limits in deployments]
    text = at_rate.side_by_side([tmp_path / "run"], predicted, None, tmp_path / "out")
    assert "Who wins at which SLOs, predicted" in text and "Who wins at which SLOs, measured" in text
    assert "0 opposite winners; 0 are shown better only in the prediction, 0 only in the measurement" in text
    assert (tmp_path / "out" / "slo_map_predicted.png").is_file() and (tmp_path / "out" / "slo_map_measured.png").is_file()
    # A run saved without per-request values is named, not a crash.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "compare.json").write_text(json.dumps({"configs": []}))
    assert at_rate.side_by_side([tmp_path / "old"], predicted, None, tmp_path / "out2").startswith(
        "No map of who wins at which SLOs: ")


def plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve", "plan", *argv], capture_output=True, text=True,
                          timeout=300)


def test_plan_cli_answers_goodput_at_the_traces_arrivals(tmp_path):
    path = tmp_path / "trace.jsonl"
    save_trace([Request(0.25 * i, "", 64, "chat", 500 if i % 8 else 3000) for i in range(48)], path)
    out = tmp_path / "plan"
    proc = plan("--hardware", "H100", "--model", "Llama-3.1-8B", "--trace", str(path), "--configs", "colocated,pd",
                "--question", "goodput", "--slo", "ttft:200", "itl:50", "--slo-grid", "ttft:100,200,400",
                "itl:25,50", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert doc["slo_map"]["axes"] == {"ttft": [100.0, 200.0, 400.0], "itl": [25.0, 50.0]}
    assert doc["recommendation"] in ("colocated", "pd") and (out / slo_map.PNG).stat().st_size > 0
    assert "goodput at the trace's own arrivals" in proc.stdout


@pytest.mark.parametrize(("argv", "message"), [
    (["--question", "goodput"], "sent all at once and has no arrivals of its own"),
    (["--slo-grid", "ttft:100,200"], "--slo-grid draws the map of --question goodput"),
    (["--question", "goodput", "--slo-grid", "ttft:1", "ttft:2"], "--slo-grid: ttft given twice"),
    (["--question", "goodput", "--slo-grid", "itl:0"], "an SLO must be a finite number above 0 ms"),
])
def test_plan_goodput_question_refuses_what_it_cannot_answer(argv, message, tmp_path):
    proc = plan("--hardware", "H100", "--model", "Llama-3.1-8B", "--num-requests", "10", "--output",
                str(tmp_path / "p"), *argv)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "p").exists()
