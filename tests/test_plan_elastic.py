"""Elastic deployments in `epdserve plan`'s simulator: a simulated role switch
drains as a live one does, the real policy (serving/elastic/policy.py) runs in the loop on
signals built from the simulated state, and `plan --configs elastic` reports its decisions.
In-process and on a hand-made platform: seconds in all."""

from __future__ import annotations

import json

import pytest

from epdserve.bench import metrics
from epdserve.bench.workload import Request, save_trace
from epdserve.plan import calibrate
from epdserve.plan.costmodel import Link, LinearStep, Platform
from epdserve.plan.sim_elastic import elastic_config
from epdserve.plan.simulate import Deployment, EngineLimits, Simulation, WorkerSpec, serve

from conftest import cli_exit

pytestmark = pytest.mark.elastic

SLOS = {"ttft": 10000.0, "tpot": 250.0}
BLOCK = 16
KV_TOKENS = 64 * 1024  # per worker: room for every request below, so none waits for blocks
LIMITS = EngineLimits(block_size=BLOCK, max_num_batched_tokens=2048)  # a step holds a whole prompt: the stalls below


def platform() -> Platform:
    """A step costs 20 ms + 1 ms per new token: a 1,000-token prefill stalls the decodes
    batched with it for a second, the interference a split removes."""
    return Platform("flat", step=lambda n: LinearStep((20.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1,),
                    kv_bytes_per_token=1000, kv_link=Link(gbs=1.0, latency_ms=5.0), price_per_device_hour=1.0,
                    router_ms=2.0, kv_capacity_tokens=lambda devices: KV_TOKENS)


def elastic(interval_s: float = 2.0, slos: dict[str, float] = SLOS) -> Deployment:
    return Deployment("elastic", (WorkerSpec("colocated"), WorkerSpec("colocated")),
                      elastic_config(slos, interval_s=interval_s))


def steady(n: int, gap_s: float, prompt: int, answer: int) -> list[Request]:
    return [Request(i * gap_s, "", answer, "chat", prompt) for i in range(n)]


def free_blocks(sim: Simulation) -> list[int]:
    return [w.free_blocks for w in sim.workers]


def test_a_switch_drains_under_the_old_role():
    # No controller decision in the run (its first tick is long after): the switch is by hand.
    sim = Simulation(elastic(interval_s=1e6), platform(), LIMITS)
    full = free_blocks(sim)
    before = steady(4, 0.01, 200, 100)             # held by the colocated workers at the switch
    after = [Request(1.0 + 0.05 * i, "", 20, "chat", 300) for i in range(6)]
    sim.add(before + after)
    sim.env.run(until=0.5)
    w0, w1 = sim.workers
    held = set(w0.holding) | set(w1.holding)
    assert held == {0, 1, 2, 3}
    w0.switch("prefill")
    w1.switch("decode")
    assert (w0.role, w1.role) == ("prefill", "decode") and w0.switching_since == 0.5
    sim.env.run(until=sim.until_finished(range(10)))
    records, traces = sim.results(range(10))
    # None lost: every request produced all its tokens.
    assert [len(r.chunk_times_s) for r in records] == [100] * 4 + [20] * 6
    # The held ones finished colocated, on the worker that took them (no hand-off) ...
    assert all(t.mode == "colocated" and t.kv_fetch_ms is None for t in traces[:4])
    # ... while the ones arriving after the switch were served split at once.
    assert all(t.mode == "pd" and t.kv_fetch_ms is not None and t.prefill_queue_ms is not None for t in traces[4:])
    # Each worker announced once its last colocated request was done: the drain time.
    switched = {e["worker"]: e for e in sim.controller.events if e["state"] == "switched"}
    last_colocated_end = max(sim.finished, key=lambda s: s.tokens[-1] if s.index < 4 else 0).tokens[-1]
    assert max(e["t"] for e in switched.values()) == pytest.approx(last_colocated_end)
    assert all(e["drain_ms"] == pytest.approx((e["t"] - 0.5) * 1e3) and e["drain_ms"] > 0 for e in switched.values())
    assert {e["previous"] for e in switched.values()} == {"colocated"}
    # The KV accounting is back to empty on both workers; nothing is held.
    assert free_blocks(sim) == full
    assert not w0.holding and not w1.holding and w0.held == w1.held == 0


def test_a_decode_stage_never_goes_back_to_its_prefill_worker():
    # A request prefilled as pd, then both workers switch to colocated while its KV crosses:
    # its decode goes to the other worker (a colocated one takes it: no decode worker is live).
    dep = Deployment("elastic", (WorkerSpec("prefill"), WorkerSpec("decode")), elastic_config(SLOS, interval_s=1e6))
    sim = Simulation(dep, platform(), LIMITS)
    sim.add([Request(0.0, "", 30, "chat", 400)])
    w0, w1 = sim.workers
    sim.env.run(until=0.4245)  # prefilled at 0.002 + 0.42 s; the KV crosses for 5.4 ms
    assert sim.finished == [] and w0.held == 0 and 0 in w0.holding  # exported, not yet imported
    w0.switch("colocated")
    w1.switch("colocated")
    sim.env.run(until=sim.until_finished(range(1)))
    (trace,) = sim.results([0])[1]
    assert trace.mode == "pd" and trace.decode_queue_ms is not None and trace.output_tokens == 30
    assert [e["worker"] for e in sim.controller.events if e["state"] == "switched"][-1] == "worker-0"
    assert free_blocks(sim) == [KV_TOKENS // BLOCK] * 2


def test_the_policy_splits_a_prefill_heavy_mix_and_reports_it():
    # 600-token prompts, 100-token answers, one a second: each prefill stalls its worker's
    # decodes for 0.62 s (> 2 x the TPOT SLO), adding ~6 ms to a stalled answer's ~22 ms
    # steps (over a 25 ms TPOT SLO) while the TTFT stays far under its SLO, and one prefill
    # worker has the capacity for them all (62 % busy).
    sim = serve(elastic(slos={"ttft": 10000.0, "tpot": 25.0}), platform(), steady(90, 1.0, 600, 100), LIMITS)
    rep = sim.controller.report()
    assert [d["action"] for d in rep["decisions"]][:1] == ["to-pd"]
    first = rep["decisions"][0]
    assert first["roles"] == {"worker-0": "prefill", "worker-1": "decode"}
    assert "prefill interference" in first["reason"] and first["signals"]["prompt_answer_ratio"] > 4
    assert first["t"] >= 10.0  # half a window of evidence first
    # The roles over time: both switches asked at the decision, each announced after its drain.
    asked = [e for e in rep["role_events"] if e["state"] == "switching" and e["t"] == first["t"]]
    assert {(e["worker"], e["previous"], e["role"]) for e in asked} == {
        ("worker-0", "colocated", "prefill"), ("worker-1", "colocated", "decode")}
    assert all(e["reason"] == first["reason"] for e in asked)
    # It does not flap: no change back within the dwell, and the later requests went split.
    assert all(b["t"] - a["t"] >= 30.0 for a, b in zip(rep["decisions"], rep["decisions"][1:]))
    traces = sim.results(range(90))[1]
    assert {t.mode for t in traces[-20:]} == {"pd"}
    assert free_blocks(sim) == [KV_TOKENS // BLOCK] * 2


def test_a_decode_heavy_mix_stays_colocated():
    sim = serve(elastic(), platform(), steady(60, 1.0, 100, 200), LIMITS)
    rep = sim.controller.report()
    assert rep["decisions"] == [] and rep["roles"] == {"worker-0": "colocated", "worker-1": "colocated"}
    assert rep["holds"] >= 25 and rep["last_hold"].startswith(("colocated: no interference", "too little evidence"))
    assert {t.mode for t in sim.results(range(60))[1]} == {"colocated"}


def test_an_elastic_run_matches_colocated_until_it_switches():
    # Until its first decision an elastic deployment is colocated-2.
    requests = steady(8, 1.0, 200, 30)
    colocated = Deployment("colocated-2", (WorkerSpec("colocated"), WorkerSpec("colocated")))
    got = metrics.compute(serve(elastic(), platform(), requests, LIMITS).results(range(8))[0])
    want = metrics.compute(serve(colocated, platform(), requests, LIMITS).results(range(8))[0])
    assert got["p95_ttft_ms"] == pytest.approx(want["p95_ttft_ms"]) and got["completed"] == 8


def _cli(tmp_path, capsys, *args: str) -> tuple[int, str]:
    """``epdserve plan ARGS`` through the CLI entry point, in-process: (exit status, stderr)."""
    cal = calibrate.save({"model": "m", "steps": {"1": {"coef": [20.0, 0.0, 1.0, 0.0, 0.0]},
                                                  "2": {"coef": [12.0, 0.0, 0.6, 0.0, 0.0]}},
                          "kv_link": {"gbs": 1.0, "latency_ms": 5.0}, "kv_bytes_per_token": 1000},
                         tmp_path / "cal.json")
    return cli_exit(capsys, ["plan", "--calibration", str(cal), *args])


def test_plan_configs_elastic_end_to_end(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    save_trace(steady(60, 1.0, 600, 100), trace)
    out = tmp_path / "plan"
    # A TPOT SLO the prefill stalls break (~6 ms on ~22 ms steps: over 25 ms); the batches
    # stay small (< 4 per worker), so the interference rule applies.
    status, err = _cli(tmp_path, capsys, "--configs", "colocated-2,elastic", "--trace", str(trace), "--slo",
                       "ttft:10000", "tpot:25", "--replay", "once", "--output", str(out))
    assert status == 0, err
    doc = json.loads((out / "plan.json").read_text())
    row = {r["name"]: r for r in doc["candidates"]}["elastic"]
    assert row["elastic"]["decisions"] and row["elastic"]["decisions"][0]["action"] == "to-pd"
    md = (out / "plan.md").read_text()
    assert "Elastic **elastic**" in md and "to-pd (worker-0 prefill, worker-1 decode)" in md
    assert "prefill interference" in md


@pytest.mark.parametrize("args, message", [
    (["--configs", "elastic-1"], "elastic-1"),
    (["--configs", "elastic", "--elastic-interval", "0"], "--elastic-interval 0: plan simulates"),
    (["--configs", "elastic", "--elastic-interval", "0.05"], "--elastic-interval: '0.05'"),
    (["--configs", "elastic", "--elastic-min-dwell", "-5"], "--elastic-min-dwell: '-5'"),
    (["--price-per-hour", "-1"], "--price-per-hour: '-1'"),
])
def test_plan_refuses_bad_elastic_input(tmp_path, capsys, args, message):
    status, err = _cli(tmp_path, capsys, *args, "--num-requests", "5")
    assert status == 2 and message in err and "Traceback" not in err
