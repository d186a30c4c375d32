"""benchmarks/plan_vs_sweep.py: its options and the join of plan's predictions with a
compare sweep (the served end-to-end run is the integrator's, on a quiet machine)."""

from __future__ import annotations

import pytest

from scripts import load_script

pytestmark = pytest.mark.plan



@pytest.fixture(scope="module")
def pvs():
    return load_script("plan_vs_sweep")


def test_workload_options_go_to_compare(pvs):
    args, rest = pvs.parse_args(["--configs", "colocated,pd", "--goodput", "ttft:2000", "tpot:150",
                                 "--workload", "synthetic", "--num-prompts", "200", "--output-len", "50:100"])
    assert args.configs == ["colocated", "pd"] and args.goodput == [("ttft", 2000.0), ("tpot", 150.0)]
    assert rest == ["--workload", "synthetic", "--num-prompts", "200", "--output-len", "50:100"]
    assert args.output == "results/plan-vs-sweep"  # --output-len is compare's, not an abbreviation


def test_join_sets_predictions_beside_the_measured_sweep(pvs):
    compare = {"configs": [{"name": "colocated", "sweep": {"max_rate": 2.0, "bracket": [2.0, 2.5]}},
                           {"name": "pd", "sweep": {"max_rate": None, "bracket": [None, 0.25]}},
                           {"name": "colocated-2", "error": "server did not start"},
                           {"name": "2p1d", "sweep": {"max_rate": 4.0, "bracket": [4.0, None]}}]}
    plans = {"steady": {"candidates": [{"name": "colocated", "max_goodput_rps": 2.2, "unbounded": False},
                                       {"name": "pd", "max_goodput_rps": 0.1, "unbounded": False},
                                       {"name": "2p1d", "max_goodput_rps": 5.0, "unbounded": False}]},
             "once": {"candidates": [{"name": "colocated", "max_goodput_rps": 3.0, "unbounded": True}]}}
    rows = pvs.join(compare, plans)
    assert rows[0]["steady"]["ratio"] == pytest.approx(1.1) and rows[0]["once"]["ratio"] == pytest.approx(1.5)
    assert rows[1]["steady"]["ratio"] is None and rows[1]["once"]["predicted_rps"] is None
    assert rows[3]["steady"]["ratio"] is None  # the sweep's HI passed: only a lower bound was measured
    text = pvs.table(rows)
    assert "| colocated | 2 [2 – 2.5] | 2.2 | 1.10 | ≥ 3 | 1.50 |" in text
    assert "| colocated-2 | server did not start |" in text
    assert "| 2p1d | ≥ 4 (HI passed) | 5 | — |" in text and "higher --sweep-rates HI" in text
    assert "Within 15% (plan steady vs measured): colocated of 4 deployments." in text


def test_a_finished_run_brings_its_own_settings(pvs, capsys):
    with pytest.raises(SystemExit):
        pvs.parse_args(["--compare-dir", "runs/x", "--seed", "0"])
    assert "drop --seed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pvs.parse_args(["--goodput", "ttft:100"])
    assert "--configs and --goodput are required" in capsys.readouterr().err
    args, _ = pvs.parse_args(["--compare-dir", "runs/x"])
    pvs.from_compare_run(args, {"configs": [{"name": "pd", "sweep": {"target_share": 0.8}}, {"name": "colocated"}],
                                "sampling": {"goodput": {"ttft": 2000.0}}, "trace": {"seed": 7}})
    assert (args.configs, args.goodput, args.goodput_target, args.seed) == (["pd", "colocated"], [("ttft", 2000.0)],
                                                                            0.8, 7)


def test_wilson_interval_brackets_a_measured_share():
    from epdserve.plan.validation import wilson_interval

    lo, hi = wilson_interval(72 / 80, 80)  # Wilson (1927): 0.8148 - 0.9484 for 72 of 80
    assert (round(lo, 3), round(hi, 3)) == (0.815, 0.948)
    assert wilson_interval(1.0, 80)[1] == 1.0 and wilson_interval(0.0, 80)[0] == 0.0
    assert wilson_interval(0.5, 0) == (0.0, 1.0)


def test_sweep_attainment_simulates_each_swept_rate(pvs):
    from epdserve.bench.workload import Request
    from epdserve.plan.costmodel import roofline_platform
    from epdserve.plan.hardware import device
    from epdserve.plan.model_spec import BUILTIN
    from epdserve.plan.validation import sweep_attainment

    platform = roofline_platform(BUILTIN["Llama-3.1-8B"], device("H100"))
    requests = [Request(0.5 * i, "", 8, "chat", 200) for i in range(20)]
    entry = {"name": "pd", "sweep": {"points": [
        {"rate": 1000.0, "slo_attainment": 0.5, "completed": 20, "failed": 0},
        {"rate": 0.5, "slo_attainment": 1.0, "completed": 20, "failed": 0}]}}
    rows = sweep_attainment(entry, 2, platform, requests, {"ttft": 10_000.0, "tpot": 1_000.0}, seed=0)
    assert [r["rate"] for r in rows] == [0.5, 1000.0]  # by rate
    assert rows[0]["simulated"] == 1.0 and rows[0]["in_interval"] and rows[0]["error"] == 0.0
    assert rows[1]["interval"][0] < 0.5 < rows[1]["interval"][1]
    text = pvs.attainment_table({"pd": rows})
    assert "| pd | 0.5 | 100.0% [83.9% – 100.0%] | 100.0% | +0.0 pt |" in text
    assert f"inside the measured 95 % interval at {sum(r['in_interval'] for r in rows)} of 2 swept rates" in text
