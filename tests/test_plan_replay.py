"""Steady-state replay (epdserve/plan/replay.py): copies, the steady-state test, and a short
trace planning as a long one of the same shape does. Simulation only: fast."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from epdserve.argtypes import config_from
from epdserve.bench.workload import Request, save_trace
from epdserve.plan import replay, search
from epdserve.plan import run as plan_run
from epdserve.plan.costmodel import LinearStep, Link, Platform
from epdserve.plan.simulate import Deployment, EngineLimits, WorkerSpec, simulate

pytestmark = pytest.mark.plan

COLOCATED = Deployment("colocated", (WorkerSpec("colocated"),))
COLOCATED_2 = Deployment("colocated-2", (WorkerSpec("colocated"), WorkerSpec("colocated")))


def platform(step=(10.0, 5.0, 0.0, 0.0, 0.0)) -> Platform:
    """A step costs ``step`` · (1, sequences, new tokens, attention keys, padded decode keys) ms."""
    return Platform("flat", step=lambda n: LinearStep(step), worker_sizes=(1,), kv_bytes_per_token=1000,
                    kv_link=Link(gbs=1e9, latency_ms=5.0), price_per_device_hour=1.0, router_ms=2.0)


def chat(n: int, seed: int = 0, prompt=(100, 300), output=(50, 100)) -> list[Request]:
    """``n`` text-less requests sent at once (re-timed to Poisson arrivals), uniform lengths."""
    rng = np.random.default_rng(seed)
    return [Request(0.0, "", int(rng.integers(output[0], output[1] + 1)), "chat",
                    int(rng.integers(prompt[0], prompt[1] + 1))) for _ in range(n)]


def test_shared_starts_are_what_a_text_shares_with_another():
    doc = "d" * 40
    texts = [doc + "a", doc + "b", "zz", "same", "same", "sam"]
    assert replay.shared_starts(texts) == [40, 40, 0, 4, 4, 3]


def test_settled_needs_a_queue_that_stopped_moving_and_stopped_growing():
    assert replay.settled(10.0, 10.4, 300) and replay.settled(0.2, 0.6, 300)  # a change under 5 %, half a request
    assert not replay.settled(10.0, 11.0, 300)                                 # 10 % of the queue
    # A queue growing by 20 requests a copy of 100: 2 % of itself, but 20 % of the arrivals.
    assert not replay.settled(1000.0, 1020.0, 100)


def test_copies_keep_the_traces_own_sharing_and_nothing_else():
    doc = "a system prompt shared by two requests " * 2
    reqs = [Request(0.0, doc + "first question", 5, "chat", 30, ({"width": 8, "height": 8, "seed": 0},)),
            Request(0.5, doc + "second question", 5, "chat", 30, ({"width": 8, "height": 8, "seed": 0},
                                                                   {"width": 8, "height": 8, "seed": 3})),
            Request(1.0, "", 5, "chat", 30)]
    copier = replay.Copier(reqs)
    first, second = copier.copy(reqs, 0, 10.0), copier.copy(reqs, 2, 20.0)
    assert [r.offset_s for r in first] == [10.0, 10.5, 11.0] and [r.prompt for r in first] == [r.prompt for r in reqs]
    # Copy 2 keeps the shared start (and the empty prompt), then differs from copy 0.
    for a, b in zip(reqs[:2], second[:2]):
        assert b.prompt.startswith(doc) and b.prompt != a.prompt
        assert b.prompt[len(doc)] == chr(replay.MARKER_BASE + 2)
    assert second[2].prompt == ""
    # An image two requests send stays; one only one request sends is a new picture.
    assert [im["seed"] for im in second[1].images] == [0, 3 + 2 * 4]


def test_copies_do_not_hit_each_others_prompts_in_the_prefix_cache():
    # Requests of 400 characters (100 tokens), none sharing a start: every copy prefills
    # in full; copy 0 of the same request sent twice would be an all-but-one-block hit.
    p = Platform("tokens", step=lambda n: LinearStep((10.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1,),
                 kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0, router_ms=2.0)
    reqs = [Request(float(i), f"{i}" * 400, 1, "chat", 100) for i in range(3)]
    copier = replay.Copier(reqs)
    twice = copier.copy(reqs, 0, 0.0) + copier.copy(reqs, 1, 10.0)
    _, traces = simulate(COLOCATED, p, twice)
    assert [t.prefill_ms for t in traces] == pytest.approx([110.0] * 6)
    _, repeated = simulate(COLOCATED, p, reqs + [Request(10.0 + i, r.prompt, 1, "chat", 100) for i, r in enumerate(reqs)])
    assert [t.prefill_ms for t in repeated[3:]] == pytest.approx([10.0 + 4.0] * 3)


def test_a_rate_the_deployment_keeps_up_with_is_steady_and_measured_after_the_warm_up():
    reqs = chat(20, prompt=(20, 40), output=(5, 10))
    run = replay.replay(COLOCATED, platform(), reqs, rate=25.0)
    assert run.steady and run.copies == 3 and run.measured == (run.copies - 2, run.copies - 1)
    # Sent all at once, the trace gets Poisson arrivals for 300 requests a copy (15 repeats).
    assert run.copy_size == 300 and len(run.records) == 600 and all(r is not None for r in run.records)
    # Every copy brings the same arrivals: once steady, the measured copies see the same
    # (the last one served under the next copy's load too, not in a draining deployment).
    ttfts = np.array([r.ttft_s for r in run.records]).reshape(2, 300)
    assert ttfts[0].mean() == pytest.approx(ttfts[1].mean(), rel=0.05)


def test_a_rate_beyond_capacity_is_not_steady():
    # One worker: 10 ms + 5 ms per sequence a step, at most 2 sequences at once; a request of
    # 8 tokens needs 8 steps of 20 ms: 2 / 160 ms = 12.5 req/s at most.
    reqs = chat(20, prompt=(20, 20), output=(8, 8))
    limits = EngineLimits(max_num_seqs=2)
    run = replay.replay(COLOCATED, platform(), reqs, rate=20.0, limits=limits, max_copies=8)
    assert not run.steady and run.copies == 8 and not run.records
    # It grew every copy: by about the 7.5 of every 20 arrivals it cannot serve.
    assert np.diff(run.in_flight)[3:] == pytest.approx(7.5 / 20 * run.copy_size, rel=0.1)
    assert replay.replay(COLOCATED, platform(), reqs, rate=8.0, limits=limits).steady
    result = search.measure_rate(COLOCATED, platform(), reqs, {"ttft": 1e6}, 20.0, limits)
    assert result["slo_attainment"] == 0.0 and result["steady_state"] is False
    # Sent once, the same rate looks fine: the 20 requests are served before the queue matters.
    once = search.measure_rate(COLOCATED, platform(), reqs, {"ttft": 1e6}, 20.0, limits, steady=False)
    assert once["slo_attainment"] == 1.0


def test_bounds_on_copies_and_requests():
    # A trace with arrivals of its own: a copy is the trace, re-timed.
    reqs = [replace(r, offset_s=0.1 * i) for i, r in enumerate(chat(50, prompt=(20, 20), output=(8, 8)))]
    run = replay.replay(COLOCATED, platform(), reqs, rate=20.0, limits=EngineLimits(max_num_seqs=2),
                        max_requests=200)
    assert not run.steady and run.copies == 4 and run.copy_size == 50
    # At least two copies, whatever the bounds: one to warm up, one to compare with it.
    assert replay.replay(COLOCATED, platform(), reqs, rate=1.0, max_requests=10).copies == 2


# CPU-like steps (ms): 12 + 2 per sequence + 0.25 per new token + 0.001 per attention key.
CPU_LIKE = (12.0, 2.0, 0.25, 0.001, 0.0)


def test_a_short_trace_plans_like_a_long_one_of_the_same_shape():
    # The short-trace example on a small, fast setting: 100-300 tokens in, 50-100 out, SLOs
    # TTFT 2 s and TPOT 150 ms, colocated-2. Sent once, 20 requests look far better than
    # 300; replayed until steady (a copy of the 20 repeats them to 300 Poisson arrivals,
    # as many as the 300 get), the two agree within 15 %.
    slos, p = {"ttft": 2000.0, "tpot": 150.0}, platform(CPU_LIKE)
    rates = {}
    for steady in (False, True):
        for n in (20, 300):
            cand = search.evaluate(COLOCATED_2, p, chat(n), slos, 0.9, EngineLimits(), iters=5, steady=steady)
            rates[steady, n] = cand.max_rate
    assert rates[False, 20] > 1.3 * rates[False, 300]
    assert rates[True, 20] == pytest.approx(rates[True, 300], rel=0.15)


def test_plan_cli_simulates_compare_configs_and_says_how_it_replayed(tmp_path):
    cal = {"model": "m", "steps": {str(n): {"coef": list(CPU_LIKE)} for n in (1, 2)},
           "kv_link": {"gbs": 1.0, "latency_ms": 0.5}, "kv_bytes_per_token": 10}
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(json.dumps(cal))
    trace = tmp_path / "trace.jsonl"
    save_trace(chat(10, prompt=(50, 80), output=(8, 16)), trace)
    docs, text = {}, {}
    for mode in ("steady", "once"):
        out = tmp_path / mode
        proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--calibration", str(cal_path),
                               "--devices", "2", "--trace", str(trace), "--configs", "colocated,pd",
                               "--slo", "ttft:2000", "tpot:150", "--replay", mode, "--output", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        docs[mode], text[mode] = json.loads((out / "plan.json").read_text()), proc.stdout
        assert docs[mode]["replay"] == mode and "Replay:" in proc.stdout
    rows = {r["name"]: r for r in docs["steady"]["candidates"]}
    assert set(rows) == {"colocated", "pd"}  # compare's names, not 1p1d
    for r in rows.values():
        assert r["steady_state"] and r["replay_copies"] >= 2 and r["above_rate_rps"] > r["max_goodput_rps"]
        assert f"| {r['replay_copies']} copies, steady; {r['above_rate_rps']:.3g} req/s: " in text["steady"]
    once = {r["name"]: r for r in docs["once"]["candidates"]}
    assert all(once[n]["replay_copies"] is None for n in once)
    # Ten requests sent once look better than they are.
    assert all(once[n]["max_goodput_rps"] > rows[n]["max_goodput_rps"] for n in rows)
    bad = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--calibration", str(cal_path),
                          "--trace", str(trace), "--configs", "colocated,3x"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown deployment '3x'" in bad.stderr and "Traceback" not in bad.stderr


def test_plan_reads_mooncake_and_azure_traces_with_the_fitting_options(tmp_path):
    """`plan --trace` takes the production formats and compare's fitting options; the
    stand-in prompts keep a Mooncake trace's shared blocks (the prefix cache hits them)."""
    cal = {"model": "m", "steps": {str(n): {"coef": list(CPU_LIKE)} for n in (1, 2)},
           "kv_link": {"gbs": 1.0, "latency_ms": 0.5}, "kv_bytes_per_token": 10}
    cal_path = tmp_path / "cal.json"
    cal_path.write_text(json.dumps(cal))
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text("".join(
        json.dumps({"timestamp": 500 * i, "input_length": 1500, "output_length": 200,
                    "hash_ids": [0, 1, 10 + i]}) + "\n" for i in range(12)))
    azure = tmp_path / "a.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i:02d}.5000000,{600 + 10 * i},{80}\n" for i in range(12)))
    base = [sys.executable, "-m", "epdserve", "plan", "--calibration", str(cal_path), "--devices", "2",
            "--configs", "colocated", "--slo", "ttft:2000", "tpot:150", "--length-scale", "0.1"]
    for trace, fmt in ((mooncake, "mooncake"), (azure, "azure")):
        out = tmp_path / fmt
        proc = subprocess.run([*base, "--trace", str(trace), "--num-requests", "10", "--seeds", "3", "--seed", "7",
                               "--output", str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "| requests" in proc.stderr and "prompt tokens in shared blocks" in proc.stderr
        doc = json.loads((out / "plan.json").read_text())
        assert doc["candidates"][0]["name"] == "colocated"
        # The trace's own arrivals are one sequence: simulated once, and said so.
        assert doc["seeds"] == [7] and doc["arrivals"] == "trace" and doc["split_vs_colocated"] is None
        assert doc["candidates"][0]["per_seed"]["max_goodput_rps"] == [doc["candidates"][0]["max_goodput_rps"]]
        assert "--seeds 3: the trace has arrivals of its own, one sequence" in proc.stderr
        assert "one arrival sequence, each deployment simulated on it once" in proc.stdout
    # Mooncake's shared blocks: every prompt starts with blocks 0 and 1, 51 tokens each
    # (512 x 0.1), 4 characters a token in the stand-in prompts; the third block is its own.
    parser = argparse.ArgumentParser()
    plan_run.add_arguments(parser)
    args = config_from(plan_run.PlanOptions, parser.parse_args(["--trace", str(mooncake), "--length-scale", "0.1"]))
    requests = plan_run._trace_requests(args.workload)
    assert [r.prompt_tokens for r in requests] == [150] * 12
    assert all(4 * 102 <= n < 4 * 103 for n in replay.shared_starts([r.prompt for r in requests]))
    bad = subprocess.run([*base[:-2], "--input-len", "10:20", "--trace", str(azure)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--trace excludes --input-len" in bad.stderr
    saved = tmp_path / "saved.jsonl"
    save_trace(chat(4), saved)
    bad = subprocess.run([*base, "--trace", str(saved)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "is a saved bench trace: --length-scale do not apply" in bad.stderr
    assert "Traceback" not in bad.stderr
