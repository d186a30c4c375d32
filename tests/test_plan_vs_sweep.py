"""benchmarks/plan_vs_sweep.py: its options and the join of plan's predictions with a
compare sweep (the served end-to-end run is the integrator's, on a quiet machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_vs_sweep.py"


@pytest.fixture(scope="module")
def pvs():
    spec = importlib.util.spec_from_file_location("plan_vs_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
