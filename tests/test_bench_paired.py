"""Paired evidence (epdserve/bench/paired.py), the rounds of --repeats auto
(epdserve/bench/rounds.py) and flagged runs left out of the verdict (repeats.combine):
in-process, on synthetic outcomes and hand-made client records."""

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from epdserve.bench import paired, rounds
from epdserve.bench.client import RequestRecord
from epdserve.bench.metrics import compute
from epdserve.bench.recommend import recommend
from epdserve.bench.repeats import combine


def outcomes(good, duration=100.0):
    n = len(good)
    return {"good": [bool(g) for g in good], "ttft_ms": [100.0] * n, "max_itl_ms": [50.0] * n,
            "e2el_ms": [1000.0] * n, "duration_s": duration}


def synthetic_runs(seed, n, k, p_a, p_b, run_sd, jitter=0.1):
    """k runs of A and B on one trace of n requests drawn from a population: request i has a
    difficulty u_i ~ U(0, 1) and is within the SLOs in a run when u_i + (its jitter in that
    run) < p + (the run's drift). The expected goodput difference is (p_a - p_b) n / 100 s."""
    rng = np.random.default_rng(seed)
    u = rng.random(n)
    runs = {"a": [], "b": []}
    for _ in range(k):
        for name, p in (("a", p_a), ("b", p_b)):
            runs[name].append(outcomes(u + rng.normal(0, jitter, n) < p + rng.normal(0, run_sd)))
    return runs["a"], runs["b"]


@pytest.mark.parametrize("k, run_sd", [(1, 0.0), (3, 0.05)])
def test_the_interval_covers_the_truth_at_its_stated_rate(k, run_sd):
    """Calibration: 100 seeded trials with a known difference (75 % vs 60 % within the SLOs,
    40 requests) and known noise (per request, and with repeats per run): the 95 % interval
    covers the true difference in >= 90 of them, and it is no wider than it needs to be
    (it misses sometimes)."""
    truth = (0.75 - 0.60) * 40 / 100.0
    covered = 0
    for seed in range(100):
        a, b = synthetic_runs(seed, 40, k, 0.75, 0.60, run_sd)
        c = paired.compare("a", a, 1.0, "b", b, 1.0, resamples=1000, seed=seed, per_request=False)
        covered += c.ci[0] <= truth <= c.ci[1]
    assert 90 <= covered <= 99


def test_pairing_removes_the_noise_both_share():
    """The same hard requests fail in both: the difference is on the 5 they disagree on, and
    the interval says A is better although each alone has a wide binomial spread."""
    a = outcomes([1] * 14 + [0] * 6 + [1] * 5)
    b = outcomes([1] * 14 + [0] * 6 + [0] * 5)
    c = paired.compare("a", [a], 2.0, "b", [b], 2.0)
    assert c.counts == {"both": 14, "a_only": 5, "b_only": 0, "neither": 6}
    assert c.goodput_a == pytest.approx(19 / 100 / 2) and c.delta == pytest.approx(5 / 200)
    assert c.verdict == "better" and c.ci[0] > 0
    assert c.relative == pytest.approx(5 / 14)


def test_identical_runs_tie_and_a_coin_flip_is_unresolved():
    same = outcomes([1, 0] * 20)
    tie = paired.compare("a", [same], 1.0, "b", [same], 1.0)
    assert tie.verdict == "tie" and tie.ci == (0.0, 0.0)
    rng = np.random.default_rng(1)
    flip = paired.compare("a", [outcomes(rng.random(20) < 0.5)], 1.0, "b", [outcomes(rng.random(20) < 0.5)], 1.0)
    assert flip.verdict == "unresolved"
    assert "no difference shown at n = 20 requests × 1 run" in paired.describe(flip, "req/s per core")


def test_decide_and_the_tie_band():
    assert paired.decide(1.0, 0.5, (0.1, 0.9)) == "better"
    assert paired.decide(0.5, 1.0, (-0.9, -0.1)) == "worse"
    assert paired.decide(1.0, 1.0, (-0.1, 0.1)) == "tie"  # within ±10 % of 1.0
    assert paired.decide(1.0, 1.0, (-0.2, 0.1)) == "unresolved"


def test_more_runs_narrow_the_interval():
    one = paired.compare("a", *synthetic_runs(3, 30, 1, 0.7, 0.6, 0.02)[:1], 1.0,
                         "b", synthetic_runs(3, 30, 1, 0.7, 0.6, 0.02)[1], 1.0, per_request=False)
    a, b = synthetic_runs(3, 30, 6, 0.7, 0.6, 0.02)
    six = paired.compare("a", a, 1.0, "b", b, 1.0, per_request=False)
    assert six.runs == 6 and (six.ci[1] - six.ci[0]) < (one.ci[1] - one.ci[0])


def test_runs_of_different_traces_are_refused():
    with pytest.raises(ValueError, match="same trace"):
        paired.compare("a", [outcomes([1, 0])], 1.0, "b", [outcomes([1, 0, 1])], 1.0)
    with pytest.raises(ValueError, match="no runs"):
        paired.compare("a", [], 1.0, "b", [outcomes([1])], 1.0)


def stream(i, ttft, freeze=0.0):
    times = [ttft + 0.05 * k + (freeze if k >= 10 else 0.0) for k in range(21)]
    return RequestRecord(index=i, start_s=float(i), chunk_times_s=times, last_chunk_s=times[-1],
                         end_s=i + times[-1], usage_completion_tokens=21, request_id=str(i),
                         success=True)


def run(name, mode, records, warning=None):
    return {"name": name, "mode": mode, "result": compute(records), "resources": {"num_cores": 2},
            "itl_stalls": 0, "host_load": {"warning": warning, "during": {"outside_share": 0.4 if warning else 0.0}}}


def test_outcomes_judge_each_request_by_the_default_slos():
    result = compute([stream(0, 0.5), stream(1, 0.5, freeze=2.0), stream(2, 2.5)])
    got = paired.outcomes(result)
    assert got["good"] == [True, False, False]  # a 2 s gap; a 2.5 s TTFT
    assert got["ttft_ms"] == pytest.approx([500.0, 500.0, 2500.0])
    assert got["max_itl_ms"] == pytest.approx([50.0, 2050.0, 50.0])
    assert got["slos_ms"] == {"ttft": 2000.0, "tpot": 200.0, "itl": 1000.0}


def test_flagged_runs_are_left_out_of_the_verdict():
    good = [stream(i, 0.5) for i in range(6)]
    bad = [stream(i, 0.5, freeze=2.0) for i in range(6)]
    entry = combine([run("pd", "pd", bad, warning="other processes used 40% of the cores"),
                     run("pd", "pd", good)])
    assert entry["flagged_runs"] == ["other processes used 40% of the cores"]
    assert len(entry["per_run"]) == 1 and all(entry["per_run"][0]["good"])
    alone = combine([run("pd", "pd", bad, warning="busy")])  # nothing else: kept, still warned
    assert "flagged_runs" not in alone and len(alone["per_run"]) == 1


def test_repeats_option_takes_a_count_or_auto():
    assert rounds.parse_repeats("auto") == "auto" and rounds.parse_repeats("3") == 3
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"'{bad}': expected a positive integer or 'auto'"):
            rounds.parse_repeats(bad)


def fake_runner(per_deployment):
    """run_one for run_rounds: the next canned entry of each deployment, and the order run."""
    order = []

    def run_one(dep, progress):
        order.append(dep.name)
        return per_deployment[dep.name][sum(1 for n in order if n == dep.name) - 1]
    return run_one, order


DEPS = [SimpleNamespace(name="colocated"), SimpleNamespace(name="pd")]


def test_auto_stops_once_the_verdict_is_clear():
    frozen = [stream(i, 0.5, freeze=2.0 if i % 2 else 0.0) for i in range(10)]
    fine = [stream(i, 0.5) for i in range(10)]
    run_one, order = fake_runner({"colocated": [run("colocated", "colocated", frozen)] * 5,
                                  "pd": [run("pd", "pd", fine)] * 5})
    runs, why = rounds.run_rounds(DEPS, run_one, "auto", 60.0)
    # Clear after one round, but one round's interval holds no drift of the machine: two.
    assert order == ["colocated", "pd", "colocated", "pd"]
    assert why == "--repeats auto stopped after 2 rounds: the verdict is clear (better)."


def test_auto_runs_rounds_until_the_budget_when_unresolved(monkeypatch):
    """A coin flip stays unresolved: rounds go on, interleaved, until the next would pass
    the budget (each round here 'takes' 60 s of a 2.5 min budget)."""
    rng = np.random.default_rng(0)
    coin = lambda name, mode: run(name, mode, [stream(i, 0.5, freeze=2.0 if rng.random() < 0.5 else 0.0)
                                               for i in range(8)])
    clock = iter(np.arange(0.0, 10_000.0, 30.0))
    monkeypatch.setattr(rounds.time, "monotonic", lambda: next(clock))
    run_one, order = fake_runner({"colocated": [coin("colocated", "colocated") for _ in range(9)],
                                  "pd": [coin("pd", "pd") for _ in range(9)]})
    runs, why = rounds.run_rounds(DEPS, run_one, "auto", 2.5)
    assert order[:4] == ["colocated", "pd", "colocated", "pd"]
    assert len(runs["pd"]) == len(runs["colocated"]) >= 1
    assert "at the budget (--budget 2.5 min)" in why and "not yet told apart" in why


def test_auto_reruns_a_deployment_whose_every_run_was_flagged():
    frozen = [stream(i, 0.5, freeze=2.0 if i % 2 else 0.0) for i in range(10)]
    fine = [stream(i, 0.5) for i in range(10)]
    run_one, order = fake_runner({"colocated": [run("colocated", "colocated", frozen)] * 3,
                                  "pd": [run("pd", "pd", fine, warning="busy")] * 2 + [run("pd", "pd", fine)]})
    runs, why = rounds.run_rounds(DEPS, run_one, "auto", 60.0)
    assert order == ["colocated", "pd", "colocated", "pd", "pd"]  # two rounds, then pd alone again
    assert why == "--repeats auto stopped after 3 rounds: the verdict is clear (better)."
    assert recommend([combine(runs["colocated"]), combine(runs["pd"])])["choice"] == "pd"


def test_a_fixed_count_runs_that_many():
    fine = [stream(i, 0.5) for i in range(4)]
    run_one, order = fake_runner({"colocated": [run("colocated", "colocated", fine)] * 2,
                                  "pd": [run("pd", "pd", fine)] * 2})
    runs, why = rounds.run_rounds(DEPS, run_one, 2, 0.001)
    assert order == ["colocated", "pd", "colocated", "pd"]
    assert why == "--repeats 2: 2 runs per configuration."
