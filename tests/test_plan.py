"""The planner: cost model, simulator, search and CLI, on hand-computable cases."""

from __future__ import annotations

import json
from dataclasses import replace
import subprocess
import sys

import numpy as np
import pytest
import torch

from epdserve.bench import metrics
from epdserve.bench.datasets import with_images
from epdserve.bench.workload import Request, save_trace
from epdserve.engine.encoder import EncodedImage
from epdserve.model.image_processor import ImageProcessor
from epdserve.plan import calibrate, hardware, search
from epdserve.plan.costmodel import (ImageCost, LinearStep, Link, Platform, Roofline, roofline_encode_ms,
                                     roofline_platform)
from epdserve.plan.model_spec import BUILTIN
from epdserve.plan.report import markdown
from epdserve.plan.validation import VALIDATED, compare_deployment, compare_limits
from epdserve.plan.simulate import Deployment, EngineLimits, KVCapacityError, WorkerSpec, simulate
from epdserve.transfer import embedding
from epdserve.bench.arrivals import retime
from epdserve.plan.serving_fit import contention_ratio, decode_gaps, fit_prefill, fit_serving, prefill_steps

pytestmark = pytest.mark.plan

COLOCATED = Deployment("colocated", (WorkerSpec("colocated"),))
PD = Deployment("1p1d", (WorkerSpec("prefill"), WorkerSpec("decode")))
EPD = Deployment("1e1p1d", (WorkerSpec("encode"), WorkerSpec("prefill"), WorkerSpec("decode")))
# The default VLM's preprocessing (model/smolvlm.py): every image is one 512-px tile, 64 tokens.
ONE_TILE = ImageProcessor(longest_edge=512, max_image_size=512, image_seq_len=64)
IMAGE = {"width": 448, "height": 448, "seed": 0}


def req(offset_s: float, prompt_tokens: int, max_tokens: int, kind: str = "chat", images=()) -> Request:
    return Request(offset_s, "", max_tokens, kind, prompt_tokens, tuple(images))


def flat_platform(step_ms: float = 10.0, per_seq_ms: float = 0.0, link_ms: float = 5.0,
                  tile_ms: float = 1000.0) -> Platform:
    """Every step costs step_ms + per_seq_ms per sequence; the hand-off (KV or embeddings)
    a fixed link_ms; encoding tile_ms per tile of the default VLM's one-tile images."""
    return Platform("flat", step=lambda n: LinearStep((step_ms, per_seq_ms, 0.0, 0.0, 0.0)), worker_sizes=(1,),
                    kv_bytes_per_token=1000, kv_link=Link(gbs=1e9, latency_ms=link_ms),
                    price_per_device_hour=1.0, router_ms=2.0,
                    images=ImageCost(ONE_TILE, lambda tiles, n: tiles * tile_ms, 576, 4))


def test_colocated_single_request_times():
    records, stages = simulate(COLOCATED, flat_platform(), [req(0.0, 5, 4)])
    r = records[0]
    # router 2 ms, prefill step 10 ms -> token 1; then one 10 ms decode step per token.
    assert r.chunk_times_s == pytest.approx([0.012, 0.022, 0.032, 0.042])
    assert stages[0].prefill_ms == pytest.approx(10.0)
    assert stages[0].colocated_queue_ms == pytest.approx(0.0)
    # The simulated trace's stages add up to its TTFT, as the router's do.
    assert stages[0].ttft_ms == pytest.approx(12.0) and stages[0].ttft_hop_ms == pytest.approx(0.0)


def test_pd_single_request_times():
    records, stages = simulate(PD, flat_platform(), [req(0.0, 5, 3)])
    # token 1 at 2 + 10 ms; KV link 5 ms; decode steps of 10 ms for tokens 2 and 3.
    assert records[0].chunk_times_s == pytest.approx([0.012, 0.027, 0.037])
    assert stages[0].kv_transfer_ms == pytest.approx(5.0, rel=1e-6)
    assert stages[0].kv_bytes == 5000
    assert stages[0].path == "disaggregated" and stages[0].ttft_hop_ms == pytest.approx(0.0)


def test_continuous_batching_shares_steps():
    # Two requests arrive together: one prefill step for both, then shared decode steps
    # that cost 10 + 1 ms per sequence.
    reqs = [req(0.0, 5, 3), req(0.0, 7, 2)]
    records, _ = simulate(COLOCATED, flat_platform(per_seq_ms=1.0), reqs)
    assert records[0].chunk_times_s == pytest.approx([0.014, 0.026, 0.037])
    assert records[1].chunk_times_s == pytest.approx([0.014, 0.026])


def test_decode_cost_follows_the_longest_context():
    # ms = 10 + 0.01 × decodes × longest context: the padded decode attention.
    platform = Platform("padded", step=lambda n: LinearStep((10.0, 0.0, 0.0, 0.0, 0.01)), worker_sizes=(1,),
                        kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0, router_ms=2.0)
    records, _ = simulate(COLOCATED, platform, [req(0.0, 100, 3)])
    assert records[0].chunk_times_s == pytest.approx([0.012, 0.023, 0.03401])
    # Batched with a 10-token prompt, the short one pays for the long one's context.
    records, _ = simulate(COLOCATED, platform, [req(0.0, 100, 3), req(0.0, 10, 2)])
    assert records[1].chunk_times_s == pytest.approx([0.012, 0.024])


def test_a_long_prefill_stalls_colocated_decode_but_not_pd():
    # A 1,000-token prompt at 1 ms/token arrives while a chat request decodes, in a step that
    # holds all of it (2,048 tokens; the machine's default here would be 512: the next test).
    platform = Platform("tokens", step=lambda n: LinearStep((10.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1,),
                        kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0)
    reqs = [req(0.0, 10, 40), req(0.1, 1000, 2, kind="long")]
    whole_steps = EngineLimits(max_num_batched_tokens=2048)
    colocated, _ = simulate(COLOCATED, platform, reqs, whole_steps)
    pd, _ = simulate(PD, platform, reqs, whole_steps)
    assert max(colocated[0].itls_s) > 1.0   # the decode waited for the whole prefill
    assert max(pd[0].itls_s) < 0.02          # its own worker kept decoding


def test_chunked_prefill_bounds_the_stall():
    platform = Platform("tokens", step=lambda n: LinearStep((10.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1,),
                        kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0)
    reqs = [req(0.0, 10, 40), req(0.1, 1000, 2)]
    chunked, _ = simulate(COLOCATED, platform, reqs, EngineLimits(max_num_batched_tokens=128,
                                                                   enable_chunked_prefill=True))
    assert max(chunked[0].itls_s) == pytest.approx(0.010 + 0.128, abs=1e-6)
    assert chunked[1].output_tokens == 2
    # serve's default, as the engine sets it: what the worker prefills in half a second (512 here).
    default, _ = simulate(COLOCATED, platform, reqs)
    assert max(default[0].itls_s) == pytest.approx(0.010 + 0.512, abs=1e-6)


def test_a_full_kv_cache_queues_requests():
    # 48 tokens of KV: 3 blocks of 16; each request needs 2 (20-token prompt + 12 tokens).
    platform = replace(flat_platform(), kv_capacity_tokens=lambda devices: 48)
    reqs = [req(0.0, 20, 12), req(0.0, 20, 12)]
    records, stages = simulate(COLOCATED, platform, reqs)
    # The second waits for the first to finish (2 + 10 + 11 × 10 ms), then prefills.
    assert records[1].chunk_times_s[0] == pytest.approx(0.132)
    assert stages[1].colocated_queue_ms == pytest.approx(120.0)
    unbounded, _ = simulate(COLOCATED, flat_platform(), reqs)
    assert unbounded[1].chunk_times_s[0] == pytest.approx(0.012)


def test_pd_holds_kv_until_it_crossed_and_the_decode_worker_queues():
    platform = replace(flat_platform(), kv_capacity_tokens=lambda devices: 48)
    records, stages = simulate(PD, platform, [req(0.0, 20, 12), req(0.0, 20, 12)])
    # Prefill: the first prompt's blocks come back once its KV crossed (12 + 5 ms), then
    # the second prefills; the decode worker takes the second in when the first is done
    # (its tokens 2-12 in steps ending at 27 ... 127 ms).
    assert records[1].chunk_times_s[:2] == pytest.approx([0.027, 0.137])
    assert stages[1].decode_queue_ms == pytest.approx(127.0 - 32.0)


def test_a_worker_that_cannot_hold_a_request_is_skipped():
    platform = replace(flat_platform(), kv_capacity_tokens=lambda devices: 16 * devices)
    with pytest.raises(KVCapacityError, match="holds 1 KV blocks of 16 tokens, the largest request needs 2"):
        simulate(COLOCATED, platform, [req(0.0, 20, 12)])
    # The roofline's KV is what 90 % of the memory holds beyond the weights: none where
    # Qwen3-32B's 64 GB of BF16 weights fill one 48 GB L40S, ~22 GB on two.
    l40s = roofline_platform(BUILTIN["Qwen3-32B"], hardware.device("L40S"))
    assert l40s.kv_capacity_tokens(1) == 0
    assert l40s.kv_capacity_tokens(2) * BUILTIN["Qwen3-32B"].kv_bytes_per_token(2) == pytest.approx(
        2 * 48e9 * 0.9 - BUILTIN["Qwen3-32B"].weight_bytes(2), rel=1e-4)


def test_linear_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    true = LinearStep((50.0, 2.0, 0.5, 1e-4, 3e-3))
    steps = [([(int(n), int(c))], int(b), int(b * x), int(x * m)) for n, c, b, x, m in
             zip(rng.integers(1, 2000, 40), rng.integers(0, 500, 40), rng.integers(0, 32, 40),
                 rng.integers(10, 1000, 40), rng.uniform(1, 3, 40))]
    fitted = LinearStep.fit(steps, [true.step_ms(*s) for s in steps])
    assert fitted.coef == pytest.approx(true.coef, rel=1e-6)


def test_roofline_decode_is_memory_bound():
    model, dev = BUILTIN["Llama-3.1-8B"], hardware.device("h100")
    step = Roofline(model, dev).step_ms([], num_decode=1, decode_context=0)
    weights = (model.layer_params + model.lm_head_params) * 2
    kv = model.kv_bytes_per_token(2)
    assert step == pytest.approx((weights + kv) / (dev.mem_bw_gbs * 1e9 * dev.bw_eff) * 1e3
                                 + dev.step_overhead_ms)
    # A 4,096-token prefill is compute-bound: well above the weight-streaming time.
    assert Roofline(model, dev).step_ms([(4096, 0)]) > 5 * step


def test_candidates_and_compare_names():
    platform = flat_platform()
    platform.worker_sizes = (1, 2)
    names = {d.name for d in search.candidates(platform, 2)}
    assert names == {"colocated", "colocated-2", "1p1d"}
    assert {d.name for d in search.candidates(platform, 2, images=True)} == names | {"1e1p1d-shared"}
    platform.worker_sizes = (1,)
    three = {d.name: d for d in search.candidates(platform, 3, images=True)}
    assert set(three) == {"colocated-3", "1p2d", "2p1d", "1e1p2d-shared", "2e2p1d-shared", "1e1p1d"}
    assert all(d.devices == 3 for d in three.values())
    assert compare_deployment("pd", 2) == Deployment("pd", (WorkerSpec("prefill", 1), WorkerSpec("decode", 1)))
    assert compare_deployment("colocated", 2).workers == (WorkerSpec("colocated", 2),)
    # The launcher puts EPD's encode and prefill workers on core 0 of 2, decode on core 1.
    assert compare_deployment("1e1p1d", 2).workers == (WorkerSpec("encode", 1, "0"), WorkerSpec("prefill", 1, "0"),
                                                       WorkerSpec("decode", 1))
    assert compare_deployment("1e1p1d", 4).workers == (WorkerSpec("encode", 1), WorkerSpec("prefill", 1),
                                                       WorkerSpec("decode", 2))
    # Elastic starts colocated on colocated-2's cores, its controller steering by serve's default SLOs.
    elastic = compare_deployment("elastic", 2)
    assert elastic.workers == compare_deployment("colocated-2", 2).workers and elastic.mode == "elastic"
    assert (elastic.elastic.policy.slo_ttft_ms, elastic.elastic.policy.slo_tpot_ms) == (2000.0, 200.0)
    with pytest.raises(ValueError, match="elastic-1"):
        compare_deployment("elastic-1", 2)
    # Each configuration is simulated with the scheduler settings it was served with.
    assert compare_limits("pd") == EngineLimits()
    assert compare_limits("colocated-chunked-noprefix") == EngineLimits(
        max_num_batched_tokens=256, enable_chunked_prefill=True, enable_prefix_caching=False)
    assert compare_limits("colocated-2-noprefix") == EngineLimits(enable_prefix_caching=False)


def test_search_finds_the_capacity_limit():
    # One worker; a request costs one 10 ms prefill step + 4 decode steps: a closed-form
    # capacity a little under 1 / (5 × 10 ms) = 20 req/s when nothing is batched. With a
    # 200 ms TTFT SLO the goodput must come out below that and above a quarter of it.
    platform = flat_platform(per_seq_ms=5.0)
    reqs = [req(0.0, 5, 5) for _ in range(200)]
    cand = search.evaluate(COLOCATED, platform, reqs, {"ttft": 200.0}, 0.9, EngineLimits(), iters=5)
    assert 2.0 < cand.max_rate < 60.0
    assert cand.result["slo_attainment"] >= 0.9
    row = cand.row(platform)
    assert row["goodput_per_device"] == pytest.approx(cand.max_rate)


def test_recommend_says_when_splitting_does_not_pay():
    rows = [{"name": "colocated-2", "max_goodput_rps": 2.0, "goodput_per_device": 1.0, "usd_per_m_output_tokens": 1.0},
            {"name": "1p1d", "max_goodput_rps": 1.6, "goodput_per_device": 0.8, "usd_per_m_output_tokens": 1.2}]
    pick, why = search.recommend(rows)
    assert pick["name"] == "colocated-2" and "does not pay off" in why
    rows[1].update(max_goodput_rps=4.0, goodput_per_device=2.0)
    pick, why = search.recommend(rows)
    assert pick["name"] == "1p1d" and "2.00x" in why
    assert search.recommend([dict(r, max_goodput_rps=0.0, goodput_per_device=0.0) for r in rows])[0] is None
    # Goodput with step times ± the calibration's uncertainty: bands that overlap cannot be told apart.
    rows[0].update(devices=2, goodput_band_rps=[1.6, 2.4])
    rows[1].update(devices=2, goodput_band_rps=[3.6, 4.4])
    assert "overlap" not in search.recommend(rows)[1]
    rows[1]["goodput_band_rps"] = [2.2, 4.4]
    assert "bands overlap (colocated-2 0.8–1.2, 1p1d 1.1–2.2 req/s per device)" in search.recommend(rows)[1]


def test_recommend_within_five_percent_prefers_colocated_then_cheaper():
    def row(name: str, per_device: float, usd: float) -> dict:
        return {"name": name, "max_goodput_rps": 2 * per_device, "devices": 2, "goodput_per_device": per_device,
                "usd_per_m_output_tokens": usd}

    pick, why = search.recommend([row("1p1d", 1.03, 1.0), row("colocated-2", 1.0, 2.0)])
    assert pick["name"] == "colocated-2" and "within 5 % of the best (1p1d" in why and "simpler to run" in why
    pick, why = search.recommend([row("2p2d", 1.03, 3.0), row("1p1d", 1.0, 1.0), row("colocated-2", 0.5, 1.0)])
    assert pick["name"] == "1p1d" and "cheaper per output token" in why


COLOCATED_2 = Deployment("colocated-2", (WorkerSpec("colocated"), WorkerSpec("colocated")))


def seed_row(dep: Deployment, rates: list[float | None], first_seed: int = 0) -> dict:
    """The row of ``dep`` whose goodput over the arrival seeds ``first_seed``... is ``rates``
    (req/s; None: the SLOs met at no rate), latencies growing with the rate."""
    cands = [search.Candidate(dep, rate, {"output_throughput": 100.0 * (rate or 0), "p95_ttft_ms": 100.0 * (rate or 0)},
                              []) for rate in rates]
    return search.seed_row(cands, flat_platform(), list(range(first_seed, first_seed + len(rates))))


def test_a_row_gives_the_median_over_the_seeds_and_their_band():
    row = seed_row(PD, [2.0, 1.0, None, 3.0, 2.5], first_seed=10)
    assert row["seeds"] == [10, 11, 12, 13, 14] and row["median_seed"] == 10
    assert row["per_seed"]["max_goodput_rps"] == [2.0, 1.0, 0.0, 3.0, 2.5]
    assert row["max_goodput_rps"] == 2.0 and row["seed_band"]["max_goodput_rps"] == [0.0, 3.0]
    assert row["goodput_per_device"] == 1.0 and row["seed_band"]["goodput_per_device"] == [0.0, 1.5]
    assert row["per_seed"]["p95_ttft_ms"] == [200.0, 100.0, 0.0, 300.0, 250.0]
    # A seed that meets the SLOs at no rate has no throughput: the median is of those that have one.
    assert row["per_seed"]["output_tok_s_per_device"] == [100.0, 50.0, None, 150.0, 125.0]
    assert row["output_tok_s_per_device"] == 112.5 and row["seed_band"]["output_tok_s_per_device"] == [50.0, 150.0]
    assert not row["unbounded"]


def test_overlapping_seed_bands_cannot_tell_split_and_colocated_apart():
    colocated = seed_row(COLOCATED_2, [2.0, 2.2, 2.4])  # 1.0-1.2 req/s per device
    split = seed_row(PD, [2.3, 2.6, 2.8])              # 1.15-1.4: 18 % ahead by the medians, yet overlapping
    pick, why = search.recommend([split, colocated])
    assert pick["name"] == "colocated-2"
    assert ("colocated-2 vs 1p1d: cannot tell apart at this load: bands overlap (goodput per device over 3 arrival "
            "seeds, min–max: colocated-2 1–1.2, 1p1d 1.15–1.4 req/s); the simpler, colocated, is preferred") in why
    verdict = search.split_vs_colocated([split, colocated])
    assert verdict == {"colocated": "colocated-2", "split": "1p1d", "seeds": 3, "overlap": True,
                       "verdict": "cannot tell apart at this load",
                       "bands": {"colocated-2": [1.0, 1.2], "1p1d": [1.15, 1.4]}}
    doc = {"platform": "p", "devices": 2, "workload": "w", "slos_ms": {"ttft": 100.0}, "target": 0.9,
           "candidates": [split, colocated], "skipped": {}, "recommendation": pick["name"], "reason": why,
           "seeds": [0, 1, 2], "arrivals": "poisson", "split_vs_colocated": verdict, "validations": []}
    text = markdown(doc)
    assert "**Recommendation: colocated-2** — colocated-2 sustains 2.2 req/s" in text
    assert "cannot tell apart at this load: bands overlap (" in text
    assert "| 1p1d | 2 | 2.6 [2.3–2.8] | 1.3 [1.15–1.4] |" in text
    assert "min–max over 3 arrival seeds (0 to 2: Poisson arrivals" in text
    # Apart: the leader by the medians, both bands stated.
    split = seed_row(PD, [2.5, 2.6, 2.8])
    pick, why = search.recommend([split, colocated])
    assert pick["name"] == "1p1d"
    assert "colocated-2 vs 1p1d: told apart, their bands do not overlap (" in why and "1p1d 1.25–1.4 req/s" in why
    assert not search.split_vs_colocated([split, colocated])["overlap"]
    # One seed is one sample: no band, no verdict; the pick as without seeds.
    one = [seed_row(PD, [2.6]), seed_row(COLOCATED_2, [2.2])]
    assert search.split_vs_colocated(one) is None
    pick, why = search.recommend(one)
    assert pick["name"] == "1p1d" and "apart" not in why
    # The split leads by more than 5 % on every seed: a leader, though colocated's spread is wide.
    assert search.recommend([seed_row(PD, [3.0, 3.1, 3.2]), seed_row(COLOCATED_2, [1.0, 2.0, 2.9])])[0]["name"] == "1p1d"


def test_a_hint_skips_the_low_rates_and_finds_the_same_goodput(monkeypatch):
    platform, reqs = flat_platform(per_seq_ms=2.0), [req(0.0, 50, 20) for _ in range(40)]
    rates = []
    measure = search.measure_rate
    monkeypatch.setattr(search, "measure_rate", lambda *a, **k: rates.append(a[4]) or measure(*a, **k))
    args = (COLOCATED, platform, reqs, {"ttft": 100.0}, 0.9, EngineLimits())
    full = search.evaluate(*args, steady=False, seed=3)
    tried = len(rates)
    for hint in (full.max_rate, full.max_rate / 7, full.max_rate * 9):  # right, far below, far above
        rates.clear()
        hinted = search.evaluate(*args, steady=False, seed=3, hint=hint)
        assert hinted.max_rate == full.max_rate and hinted.above[0] == full.above[0]
    rates.clear()
    search.evaluate(*args, steady=False, seed=3, hint=full.max_rate)
    assert min(rates) > 0.01 and len(rates) < tried


def roofline_plan(out, hardware_name: str, model: str, input_len: int, output_len: int, num: int, *slo: str):
    """`epdserve plan` on 2 devices of ``hardware_name`` for fixed-length requests."""
    return subprocess.run([sys.executable, "-m", "epdserve", "plan", "--hardware", hardware_name, "--model", model,
                           "--devices", "2", "--input-len", f"{input_len}:{input_len}", "--output-len",
                           f"{output_len}:{output_len}", "--num-requests", str(num), "--slo", *slo,
                           # the CLI's output, not the replay (tests/test_plan_replay.py): one pass is quicker
                           "--replay", "once", "--output", str(out)], capture_output=True, text=True, timeout=300)


def test_roofline_plan_cli(tmp_path):
    out = tmp_path / "plan"
    proc = roofline_plan(out, "H200", "Llama-3.1-8B", 1000, 100, 60, "ttft:500", "tpot:30")
    assert proc.returncode == 0, proc.stderr
    assert "**Recommendation:" in proc.stdout
    assert (out / "plan.json").is_file() and (out / "goodput.png").stat().st_size > 0


def test_plan_skips_deployments_whose_workers_the_weights_fill(tmp_path):
    # Qwen3-32B's 64 GB of BF16 weights fill one 48 GB L40S: only TP2 remains on two.
    out = tmp_path / "plan"
    proc = roofline_plan(out, "L40S", "Qwen3-32B", 500, 50, 20, "ttft:2000", "tpot:100")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert [r["name"] for r in doc["candidates"]] == ["colocated"]
    assert set(doc["skipped"]) == {"colocated-2", "1p1d"}
    assert "worker of 1 device(s) holds 0 KV blocks" in doc["skipped"]["1p1d"]
    assert "| colocated-2 | skipped:" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "TPU9"], "unknown hardware 'TPU9'"),
    (["--target", "1.5"], "--target 1.5"),
    (["--hardware", "cpu", "--model", "/nonexistent/model"], "/nonexistent/model: no such file"),
    (["validate", "--calibration", "/nonexistent/cal.json", "--compare-dir", "/tmp"], "epdserve plan calibrate"),
    (["--hardware", "H100", "--trace", "/nonexistent/t.jsonl", "--input-len", "10:20"], "--trace excludes --input-len"),
    (["--compare-dir", "/tmp"], "--compare-dir is for `epdserve plan validate`"),
    (["--seeds", "0"], "argument --seeds: '0': must be >= 1"),
    (["--seeds", "-3"], "argument --seeds: '-3': must be >= 1"),
])
def test_plan_cli_errors(argv, message):
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--model", "Llama-3.1-8B", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_bad_calibrations_are_clear_errors(tmp_path):
    bad = {"negative": dict(_gap_calibration(), steps={"1": {"coef": [-1.0, 0, 0, 0, 0]}}),
           "null link": dict(_gap_calibration(), kv_link=None),
           "text slowdown": dict(_gap_calibration(), serving={"decode_slowdown": "fast"})}
    for name, cal in bad.items():
        with pytest.raises(ValueError, match="not a usable epdserve calibration"):
            calibrate.load(calibrate.save(cal, tmp_path / f"{name}.json"))
    with pytest.raises(ValueError, match="cannot be read"):
        calibrate.load(tmp_path)


def test_validate_refuses_a_directory_named_twice_and_foreign_outputs(tmp_path):
    cal = calibrate.save(_gap_calibration(), tmp_path / "cal.json")
    run = tmp_path / "run"
    run.mkdir()
    save_trace([req(0.0, 5, 2)], run / "trace.jsonl")
    (run / "compare.json").write_text(json.dumps({"results": []}))  # not what compare writes
    for dirs, message in (([run, run], "named twice"), ([run], "not an `epdserve compare` output")):
        proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "validate", "--calibration", str(cal),
                               "--compare-dir", *map(str, dirs)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_trace_too_short_to_load_a_deployment_is_flagged():
    # Three tiny requests sent once meet the SLOs even all at once: no rate finds the goodput.
    cand = search.evaluate(COLOCATED, flat_platform(), [req(0.0, 5, 2)] * 3, {"ttft": 1000.0}, 0.9, EngineLimits(),
                           steady=False)
    assert cand.unbounded and cand.row(flat_platform())["unbounded"]
    # Replayed back to back until steady, they find one, where the queue starts to grow
    # (steps of 10 ms + 5 per sequence: at most 200 sequence-steps/s, 100 of these requests).
    platform = flat_platform(per_seq_ms=5.0)
    steady = search.evaluate(COLOCATED, platform, [req(0.0, 5, 2)] * 3, {"ttft": 1000.0}, 0.9, EngineLimits())
    row = steady.row(platform)
    assert 50 < row["max_goodput_rps"] < 100
    assert not row["unbounded"] and row["max_goodput_rps"] > 0 and row["steady_state"]
    assert row["above_rate_rps"] > row["max_goodput_rps"] and row["above_steady_state"] is False
    text = markdown({"platform": "flat", "devices": 1, "workload": "w", "slos_ms": {"ttft": 1000.0},
                      "target": 0.9, "candidates": [cand.row(flat_platform())], "skipped": {},
                      "recommendation": "colocated", "reason": "r", "validations": None})
    assert "| colocated | 1 | ≥ " in text and "the trace is too short" in text
    rows = [cand.row(flat_platform()), dict(cand.row(flat_platform()), name="colocated-2")]
    assert search.recommend(rows) == (None, "colocated, colocated-2 meet the SLOs even with the whole trace in "
                                            "flight at once, so they cannot be ranked: plan with more requests")


def test_image_costs_follow_the_processor():
    cost = ImageCost(ONE_TILE, lambda tiles, n: 0.0, 576, 4)
    assert (cost.tiles((448, 448)), cost.tokens((448, 448))) == (1, 64)
    # <fake><global-img> 64 x <image> <fake>, and the newline before the image part.
    assert cost.prompt_tokens((448, 448)) == 64 + 3 + 1
    # The encode worker's frame is the float32 embeddings plus a header under 1 KB.
    frame = embedding.pack([EncodedImage("a" * 64, torch.zeros(64, 576), 0, 0, 0.0)])
    assert cost.embedding_bytes((448, 448)) == 64 * 576 * 4 == 147456
    assert 0 < len(frame) - cost.embedding_bytes((448, 448)) < 1024
    # SmolVLM-256M: 1024x768 -> 2048x1536 -> 3 x 4 tiles of 512 px + the global image;
    # 12 x (<fake><row_r_col_c>), 3 row newlines (the last merged with the blank line).
    smolvlm = roofline_platform(BUILTIN["SmolVLM-256M"], hardware.device("H100")).images
    assert smolvlm.tiles((1024, 768)) == 13
    assert smolvlm.tokens((1024, 768)) == 13 * 64
    assert smolvlm.prompt_tokens((1024, 768)) == 13 * 64 + 24 + 3 + 3 + 1
    assert smolvlm.embedding_bytes((1024, 768)) == 13 * 64 * 576 * 2  # bf16 on a GPU
    assert roofline_platform(BUILTIN["Llama-3.1-8B"], hardware.device("H100")).images is None


def test_vision_roofline_counts_the_siglip_tower():
    model, dev = BUILTIN["SmolVLM-256M"], hardware.device("H100")
    d, f, layers, patches = 768, 3072, 12, (512 // 16) ** 2
    weights = 3 * 16 * 16 * d + layers * (4 * d * d + 2 * d * f)
    projection = d * 16 * 576  # pixel shuffle 4 -> 16 x 768 wide tokens -> 576
    assert model.vision_params == weights + projection
    flops = 2 * patches * weights + 4 * layers * patches ** 2 * d + 2 * 64 * projection
    assert model.vision_flops_per_tile() == pytest.approx(flops)
    assert roofline_encode_ms(model, dev, 13) == pytest.approx(
        13 * flops / (dev.peak_tflops * 1e12 * dev.compute_eff) * 1e3 + dev.step_overhead_ms)
    assert roofline_encode_ms(model, dev, 0) == 0.0


def test_colocated_encodes_in_the_worker_epd_on_encode_workers():
    platform = flat_platform()
    records, stages = simulate(COLOCATED, platform, [req(0.0, 5, 2, images=[IMAGE])])
    # router 2 ms, encode 1,000 ms in the worker, prefill step 10 ms, one decode step.
    assert records[0].chunk_times_s == pytest.approx([1.012, 1.022])
    assert stages[0].prompt_tokens == 5 + 68
    assert stages[0].encode_ms == pytest.approx(1000.0)
    records, stages = simulate(EPD, platform, [req(0.0, 5, 2, images=[IMAGE])])
    # ... in EPD the embeddings then cross the 5 ms link to the prefill worker, the KV
    # another 5 ms to the decode worker.
    assert records[0].chunk_times_s == pytest.approx([1.017, 1.032])
    assert stages[0].embedding_bytes == 147456
    assert stages[0].embedding_transfer_ms == pytest.approx(5.0, rel=1e-3)
    assert stages[0].encode_ms == pytest.approx(1000.0)


def test_encoding_stalls_colocated_decode_but_not_epd():
    # A chat request decodes; one with an image arrives 100 ms later.
    reqs = [req(0.0, 10, 40), req(0.1, 10, 2, images=[IMAGE])]
    colocated, _ = simulate(COLOCATED, flat_platform(), reqs)
    epd, _ = simulate(EPD, flat_platform(), reqs)
    assert max(colocated[0].itls_s) > 1.0   # its steps waited for the whole encode
    assert max(epd[0].itls_s) < 0.02


def test_shared_devices_split_their_time():
    # Encode and prefill on one device: a prefill step during an encode runs at half speed,
    # and the encode loses what the step took.
    shared = Deployment("1e1p1d-shared", (WorkerSpec("encode", 1, "p0"), WorkerSpec("prefill", 1, "p0"),
                                          WorkerSpec("decode")))
    assert shared.devices == 2
    records, _ = simulate(shared, flat_platform(), [req(0.0, 5, 1, images=[IMAGE]), req(0.1, 5, 1)])
    assert records[1].chunk_times_s == pytest.approx([0.022])     # 2 + 2 x 10 ms
    assert records[0].chunk_times_s == pytest.approx([1.027])     # 2 + 1,010 + 5 + 10 ms


def test_a_repeated_image_is_encoded_once_per_worker():
    platform = flat_platform()
    records, stages = simulate(COLOCATED, platform, [req(0.0, 5, 1, images=[IMAGE]), req(2.0, 5, 1, images=[IMAGE])])
    assert stages[1].encode_ms == 0.0
    assert records[1].chunk_times_s == pytest.approx([0.012])


def _cpu_like(tile_ms: float) -> Platform:
    """Steps as calibrated on this machine's 1-core workers (SmolLM2-135M, float32), one
    512-px tile per image at ``tile_ms``."""
    return Platform("cpu-like", step=lambda n: LinearStep((50.0, 2.5, 3.3, 9e-4, 0.014)), worker_sizes=(1,),
                    kv_bytes_per_token=30 * 2 * 3 * 64 * 4, kv_link=Link(14.5, 0.6), price_per_device_hour=1.0,
                    router_ms=3.0, template_tokens=30,
                    images=ImageCost(ONE_TILE, lambda tiles, n: tiles * tile_ms, 576, 4))


def _image_trace(n: int, images: int, max_tokens: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    return with_images([req(0.0, int(rng.integers(50, 150)), max_tokens) for _ in range(n)], images, (448, 448))


COLOCATED_4 = Deployment("colocated-4", (WorkerSpec("colocated"),) * 4)
EPD_4 = Deployment("2e1p1d", (WorkerSpec("encode"),) * 2 + (WorkerSpec("prefill"), WorkerSpec("decode")))


@pytest.mark.parametrize("seed", [0, 1])
def test_epd_wins_ttft_when_encoding_dominates(seed):
    # 4 images of 2 s each per request, 8-token answers, 4 devices: a colocated worker
    # encodes its request's 4 images one after another (8 s); EPD's two encode workers
    # take 2 each (4 s).
    reqs = retime(_image_trace(60, 4, 8, seed), 0.02, seed)
    colocated = metrics.compute(simulate(COLOCATED_4, _cpu_like(2000.0), reqs)[0])
    epd = metrics.compute(simulate(EPD_4, _cpu_like(2000.0), reqs)[0])
    assert colocated["p95_ttft_ms"] > 8000
    assert epd["p95_ttft_ms"] < 0.85 * colocated["p95_ttft_ms"]


def test_epd_does_not_pay_for_long_answers():
    # One image, 256-token answers: EPD's one decode worker carries every decode, so under
    # a TPOT SLO the four colocated workers serve more than twice the rate.
    reqs, slos = _image_trace(60, 1, 256), {"ttft": 10000.0, "tpot": 200.0}
    colocated = search.evaluate(COLOCATED_4, _cpu_like(2000.0), reqs, slos, 0.9, EngineLimits(), iters=4)
    epd = search.evaluate(EPD_4, _cpu_like(2000.0), reqs, slos, 0.9, EngineLimits(), iters=4)
    assert colocated.max_rate > 2 * epd.max_rate > 0


def test_calibrated_platform_encodes_per_tile():
    cal = {"model": "m", "steps": {"1": {"coef": [1.0] * 5}}, "kv_link": {"gbs": 1.0, "latency_ms": 0.5},
           "kv_bytes_per_token": 10,
           "vision": {"model": "/models/SmolVLM-256M", "encode": {"1": {"ms_per_tile": 2500.0}}, "hidden_size": 576,
                      "dtype_bytes": 4, "processor": {k: getattr(ONE_TILE, k) for k in calibrate.PROCESSOR_FIELDS}}}
    # The VLM's language model has step fits of its own.
    with pytest.raises(ValueError, match="rerun `epdserve plan calibrate`"):
        calibrate.platform_from(cal, vlm=True)
    cal["vision"]["steps"] = {"1": {"coef": [3.0] * 5}}
    vlm = calibrate.platform_from(cal, vlm=True)
    assert vlm.step(1).coef == (3.0,) * 5 and vlm.name == "SmolVLM-256M on this CPU"
    assert vlm.images.encode_ms(3, 1) == 7500.0
    assert vlm.images.embedding_bytes((448, 448)) == 147456
    # The text model takes no images, though its calibration timed the VLM too.
    text = calibrate.platform_from(cal)
    assert text.step(1).coef == (1.0,) * 5 and text.images is None
    with pytest.raises(ValueError, match="has images"):
        simulate(COLOCATED, text, [req(0.0, 5, 1, images=[IMAGE])])


def test_roofline_plan_cli_with_images(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--hardware", "H100", "--model",
                           "SmolVLM-256M", "--devices", "3", "--input-len", "100:100", "--output-len", "20:20",
                           "--num-requests", "40", "--images-per-request", "2", "--image-size", "1024x768",
                           "--slo", "ttft:500", "tpot:30", "--replay", "once", "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| 1e1p1d |" in proc.stdout and "**Recommendation:" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--hardware", "H100", "--model",
                           "Llama-3.1-8B", "--images-per-request", "1", "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "has images" in proc.stderr and "Traceback" not in proc.stderr


def test_served_decode_steps_take_the_slowdown():
    # PD: prefill 10 ms (no decodes: as calibrated); decode steps 10 ms × 1.5.
    platform = flat_platform()
    platform.decode_slowdown = 1.5
    records, _ = simulate(PD, platform, [req(0.0, 5, 3)])
    assert records[0].chunk_times_s == pytest.approx([0.012, 0.032, 0.047])
    # Colocated, 10 ms + 1 ms per sequence: A's decode alone 11 × 1.5 = 16.5 ms; B (in at
    # 13 + 2 ms) is prefilled in the next step with A's decode: 12 + 0.5 × 11 = 17.5 ms.
    platform = flat_platform(per_seq_ms=1.0)
    platform.decode_slowdown = 1.5
    records, _ = simulate(COLOCATED, platform, [req(0.0, 5, 3), req(0.013, 5, 1)])
    assert records[0].chunk_times_s == pytest.approx([0.013, 0.0295, 0.047])
    assert records[1].chunk_times_s == pytest.approx([0.034])


# ms = 10 + 1 per sequence + 0.1 per attention key (cached context + 1 per decode).
GAP_STEP = LinearStep((10.0, 1.0, 0.0, 0.1, 0.0))


def test_decode_gaps_rebuild_the_batch():
    # Decode worker (prefilled elsewhere: the first gap spans the hand-off and is left out).
    # Middle of A's gap 0.1-0.2: A has 2 tokens (5 + 1 cached), B 1 (7 + 0): 10 + 2 + 1.5.
    # Middles 0.25 and 0.27: A 5 + 2, B 7 + 1 cached: 10 + 2 + 1.7.
    seqs = [{"worker": "d", "prompt_tokens": 5, "token_times_s": [0.0, 0.1, 0.2, 0.3], "busy_s": None},
            {"worker": "d", "prompt_tokens": 7, "token_times_s": [0.12, 0.22, 0.32], "busy_s": None}]
    gaps = decode_gaps(seqs, lambda worker: GAP_STEP)
    assert np.array(gaps) == pytest.approx(np.array([(100.0, 13.5, 0), (100.0, 13.7, 0), (100.0, 13.7, 0)]))
    # Contended: the step's middle fell where every other core was busy.
    gaps = decode_gaps(seqs, lambda worker: GAP_STEP, lambda worker, t: t > 0.2)
    assert [g[2] for g in gaps] == [False, True, True]
    # Colocated: B's prefill (0.12-0.15) was in A's step 0.1-0.2, which is left out; A's
    # first gap counts (A alone, 5 cached: 10 + 1 + 0.6), and so does B's 0.15-0.25 (B
    # alone, 5 cached: A's last token came at its middle, 0.2). Another worker's request
    # is a batch of its own (9 cached: 10 + 1 + 1.0).
    seqs = [{"worker": "c", "prompt_tokens": 5, "token_times_s": [0.0, 0.1, 0.2], "busy_s": (-0.05, 0.0)},
            {"worker": "c", "prompt_tokens": 5, "token_times_s": [0.15, 0.25], "busy_s": (0.12, 0.15)},
            {"worker": "other", "prompt_tokens": 9, "token_times_s": [0.0, 0.3], "busy_s": (-0.1, 0.0)}]
    gaps = decode_gaps(seqs, lambda worker: GAP_STEP)
    assert np.array(gaps) == pytest.approx(np.array([(100.0, 11.6, 0), (100.0, 11.6, 0), (300.0, 12.0, 0)]))


def test_fit_serving_is_the_median_p95_ratio():
    # p95 (linear) of [10, 20] is 19.5 and of [5, 10] 9.75: x2; the second run x3; median 2.5.
    runs = [[(10.0, 5.0, False), (20.0, 10.0, False)], [(30.0, 10.0, False)], []]
    assert fit_serving(runs) == pytest.approx((2.5, 1.0))
    with pytest.raises(ValueError, match="no decode-only steps"):
        fit_serving([[]])
    with pytest.raises(ValueError, match="no decode-only steps"):
        fit_serving([[(10.0, 5.0, True)]])


def test_fit_serving_takes_contention_within_each_run():
    # Run 1: free steps at x2 (p95 x2), contended at x2.6: x1.3 of its free ones. Run 2:
    # free x1, contended x1.5. The contended slowdown is the median ratio of the two.
    runs = [[(10.0, 5.0, False), (20.0, 10.0, False), (26.0, 10.0, True)],
            [(10.0, 10.0, False), (15.0, 10.0, True), (30.0, 20.0, True)]]
    assert contention_ratio(runs[0]) == pytest.approx(1.3)
    assert contention_ratio(runs[0][:2]) is None
    slowdown, contended = fit_serving(runs)
    assert slowdown == pytest.approx(1.5) and contended == pytest.approx(1.4)


def test_prefill_steps_leave_out_batched_prefills():
    # Worker c (colocated): A's prefill 0.0-0.1 runs alone (40 new, 8 cached: 10 + 1 + 0.1 ×
    # (40·8 + 40·41/2) = 125 ms by the step model); B's 0.2-0.3 while A decodes (A has 2
    # tokens before 0.25: 48 + 1 cached): the step's decode part 10 + 1 + 5.0; C's and D's
    # overlap on worker p and are left out, as is E, whose cached tokens are not known.
    def seq(worker, times, prefill):
        return {"worker": worker, "prompt_tokens": 48, "token_times_s": times, "busy_s": None, "prefill": prefill}

    seqs = [seq("c", [0.1, 0.2, 0.4], ("c", 0.0, 0.1, 40, 8)), seq("c", [0.3, 0.5], ("c", 0.2, 0.3, 40, 8)),
            seq("d", [0.1, 0.2], ("p", 0.0, 0.1, 40, 8)), seq("d", [0.15, 0.2], ("p", 0.05, 0.15, 40, 8)),
            seq("c", [0.7, 0.8], None)]
    steps = prefill_steps(seqs, lambda worker: GAP_STEP)
    alone = 10 + 1 + 0.1 * (40 * 8 + 40 * 41 / 2)
    assert [s[0] for s in steps] == ["c", "c"]
    assert np.array([s[1:] for s in steps]) == pytest.approx(np.array([(100.0, alone, 0.0),
                                                                      (100.0, alone - 10.0, 16.0)]))


def test_fit_prefill_is_the_median_per_worker_size():
    # Run 1: two 1-core prefills at x2 and x3 (median 2.5); one 2-core at x1.2, its 10 ms of
    # decodes taken at the decode slowdown (x1.5): (27 - 15) / 10. Run 2: a 1-core at x1.5.
    runs = [([("a", 20.0, 10.0, 0.0), ("a", 30.0, 10.0, 0.0), ("b", 27.0, 10.0, 10.0)], {"a": 1, "b": 2}),
            ([("a", 15.0, 10.0, 0.0)], {"a": 1}), ([], {"a": 1})]
    assert fit_prefill(runs, decode_slowdown=1.5) == pytest.approx({1: 2.0, 2: 1.2})
    assert fit_prefill([], 1.0) == {}


def test_served_prefills_take_their_worker_sizes_slowdown():
    # PD: router 2 ms, the prefill step 10 ms × 2 on the 1-core prefill worker, then the
    # hand-off 5 ms and decodes of 10 ms, as calibrated.
    platform = replace(flat_platform(), prefill_slowdown={1: 2.0})
    records, _ = simulate(PD, platform, [req(0.0, 5, 3)])
    assert records[0].chunk_times_s == pytest.approx([0.022, 0.037, 0.047])
    # Another size's slowdown does not apply.
    assert simulate(PD, replace(platform, prefill_slowdown={2: 2.0}), [req(0.0, 5, 3)])[0][0].chunk_times_s \
        == pytest.approx([0.012, 0.027, 0.037])
    # Colocated, 10 ms + 1 per sequence, prefills x3: A's prefill alone 11 × 3 = 33 ms; B
    # (in at 30 ms) joins A's decode in a step of 12 ms by the model, 11 of them the
    # decode's: 11 + 1 × 3 = 14 ms, B's first token 17 ms after it came; A's last 11 ms.
    platform = replace(flat_platform(per_seq_ms=1.0), prefill_slowdown={1: 3.0}, router_ms=0.0)
    records, _ = simulate(COLOCATED, platform, [req(0.0, 5, 3), req(0.030, 5, 1)])
    assert records[0].chunk_times_s == pytest.approx([0.033, 0.047, 0.058])
    assert records[1].chunk_times_s == pytest.approx([0.017])


def test_contended_steps_take_longer():
    # Two 1-core replicas, each with one request: while both decode, every step is
    # contended and its decode work takes x2; a lone replica is never contended.
    platform = replace(flat_platform(), contended_slowdown=2.0, router_ms=0.0)
    two = Deployment("colocated-2", (WorkerSpec("colocated"),) * 2)
    records, _ = simulate(two, platform, [req(0.0, 5, 3), req(0.0, 5, 3)])
    assert records[0].chunk_times_s == pytest.approx([0.010, 0.030, 0.050])
    records, _ = simulate(COLOCATED, platform, [req(0.0, 5, 3)])
    assert records[0].chunk_times_s == pytest.approx([0.010, 0.020, 0.030])


def test_calibration_fits_the_median_of_its_rounds():
    shapes = [([(n, 0)], 0, 0, 0) for n in (16, 64, 256)] + [([], b, b * 100, 100) for b in (1, 4, 16)]

    def timed(scale: float) -> list[dict]:
        return [{"prefill": [list(c) for c in prefill], "num_decode": n, "decode_context": ctx,
                 "decode_max_context": top, "ms": GAP_STEP.step_ms(prefill, n, ctx, top) * scale}
                for prefill, n, ctx, top in shapes]

    # One round taken while the machine was busy: twice as slow. The fit ignores it, the spread shows it.
    samples, spread = calibrate._median_rounds([timed(1.0), timed(2.0), timed(1.0)])
    assert [x["ms"] for x in samples] == pytest.approx([x["ms"] for x in timed(1.0)])
    assert spread == pytest.approx(1.0)
    assert calibrate._median_rounds([timed(1.0)])[1] == 0.0


def _gap_calibration() -> dict:
    return {"model": "m", "steps": {str(n): {"coef": list(GAP_STEP.coef)} for n in (1, 2)},
            "kv_link": {"gbs": 1.0, "latency_ms": 0.5}, "kv_bytes_per_token": 10}


def test_calibration_without_serving_still_loads(tmp_path):
    path = calibrate.save(_gap_calibration(), tmp_path / "cal.json")
    assert calibrate.platform_from(calibrate.load(path)).decode_slowdown == 1.0
    cal = dict(_gap_calibration(), serving={"decode_slowdown": 1.4})
    assert calibrate.platform_from(cal).decode_slowdown == 1.4


def test_calibrate_from_compare_cli(tmp_path):
    # A PD compare run of the two decodes of test_decode_gaps_rebuild_the_batch: p95 of the
    # measured gaps 100 ms, of the step model's [13.5, 13.7, 13.7] 13.7 ms.
    run = tmp_path / "run"
    run.mkdir()
    save_trace([req(0.0, 5, 4), req(0.1, 7, 3)], run / "trace.jsonl")
    workers = [{"worker_id": "prefill-0", "role": "prefill", "cores": [0]},
               {"worker_id": "decode-0", "role": "decode", "cores": [1]}]
    result = {"request_ids": ["a", "b"], "start_times": [0.0, 0.1], "ttfts": [0.0, 0.02],
              "itls": [[0.1, 0.1, 0.1], [0.1, 0.1]]}
    (run / "compare.json").write_text(json.dumps({"configs": [{"name": "pd", "resources": {"workers": workers},
                                                               "result": result}]}))
    # Their prefills (50 ms each, apart, nothing cached) on the 1-core prefill worker: 5
    # tokens are 10 + 1 + 0.1 × 15 = 12.5 ms by the step model (x4), 7 are 13.8 (x3.62).
    (run / "pd.server.jsonl").write_text("".join(
        json.dumps({"request_id": r, "mode": "pd", "prefill_worker": "prefill-0", "decode_worker": "decode-0",
                    "prefill_ms": 50.0, "prompt_tokens": n, "cached_tokens": 0}) + "\n" for r, n in (("a", 5), ("b", 7))))
    cal = calibrate.save(_gap_calibration(), tmp_path / "cal.json")
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "calibrate", "--from-compare", str(run),
                           "--calibration", str(cal)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3 decode steps" in proc.stdout
    serving = calibrate.load(cal)["serving"]
    assert serving["decode_slowdown"] == pytest.approx(100.0 / 13.7)
    assert serving["prefill_slowdown"] == pytest.approx({"1": (50 / 12.5 + 50 / 13.8) / 2})
    assert "prefills x3.81 on 1-core workers" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "calibrate", "--from-compare",
                           str(tmp_path / "missing"), "--calibration", str(cal)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "not an `epdserve compare` output" in proc.stderr and "Traceback" not in proc.stderr


def test_step_uncertainty_is_half_the_spread_of_the_served_runs():
    assert calibrate.step_uncertainty({}) == 0.0
    assert calibrate.step_uncertainty({"decode_slowdown": 1.2, "ratios": {"a": 1.2}}) == 0.0
    serving = {"decode_slowdown": 1.1, "ratios": {"a": 1.0, "b": 1.1, "c": 1.32}}
    assert calibrate.step_uncertainty(serving) == pytest.approx(0.16 / 1.1)
    assert calibrate.platform_from(dict(_gap_calibration(), serving=serving)).step_uncertainty == \
        pytest.approx(0.16 / 1.1)


def test_time_scale_scales_steps_and_encodes():
    platform = replace(flat_platform(), router_ms=0.0)
    one = [req(0.0, 100, 3, images=[IMAGE])]
    records, stages = simulate(COLOCATED, platform, one)
    slow_records, slow_stages = simulate(COLOCATED, replace(platform, time_scale=2.0), one)
    assert slow_stages[0].encode_ms == pytest.approx(2 * stages[0].encode_ms)
    assert slow_records[0].chunk_times_s == pytest.approx([2 * t for t in records[0].chunk_times_s])


def test_cpu_plan_gives_goodput_bands(tmp_path):
    serving = {"decode_slowdown": 1.0, "ratios": {"a": 0.8, "b": 1.2}}  # known to ±20%
    cal = calibrate.save(dict(_gap_calibration(), serving=serving), tmp_path / "cal.json")
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--calibration", str(cal), "--devices", "2",
                           "--input-len", "50:50", "--output-len", "8:8", "--num-requests", "30",
                           "--slo", "ttft:200", "tpot:40", "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "with every step 20% faster or slower" in proc.stdout
    assert "Not validated yet" in proc.stdout
    doc = json.loads((out / "plan.json").read_text())
    rows = doc["candidates"]
    assert {r["name"] for r in rows} == {"colocated", "colocated-2", "1p1d"}
    for r in rows:
        low, high = r["goodput_band_rps"]
        assert low < r["max_goodput_rps"] < high  # slower steps sustain less, faster more
    # The default 5 arrival seeds, from --seed on: each figure a median, with its band.
    assert doc["seeds"] == [0, 1, 2, 3, 4] and doc["arrivals"] == "poisson"
    for r in rows:
        rates = r["per_seed"]["max_goodput_rps"]
        assert len(rates) == 5 and r["max_goodput_rps"] == pytest.approx(float(np.median(rates)))
        assert r["seed_band"]["max_goodput_rps"] == [min(rates), max(rates)]
        assert f"| {r['name']} | 2 | {r['max_goodput_rps']:.3g} [{min(rates):.3g}–{max(rates):.3g}] (" in proc.stdout
    verdict = doc["split_vs_colocated"]
    (colocated,) = [r for r in rows if r["name"] == verdict["colocated"]]
    (split,) = [r for r in rows if r["name"] == verdict["split"]]
    low, high = colocated["seed_band"]["goodput_per_device"], split["seed_band"]["goodput_per_device"]
    assert verdict["overlap"] == (low[0] <= high[1] and high[0] <= low[1])
    assert ("cannot tell apart at this load" if verdict["overlap"] else "told apart") in doc["reason"]


def test_validate_takes_repeats_and_reports_their_spread(tmp_path):
    reqs = [req(0.05 * i, 30, 8) for i in range(12)]
    # Served runs spread ±10% around the fitted slowdown: predictions are bands of ±10%.
    cal = calibrate.save(dict(_gap_calibration(), serving={"decode_slowdown": 1.0, "ratios": {"a": 0.9, "b": 1.1}}),
                         tmp_path / "cal.json")
    records, _ = simulate(compare_deployment("colocated", 2), calibrate.platform_from(calibrate.load(cal)), reqs,
                          compare_limits("colocated"))
    predicted = metrics.compute(records)
    runs = []
    for name, scale in (("run1", 1.1), ("run2", 0.9)):  # measured 10 % above and below the prediction
        runs.append(tmp_path / name)
        runs[-1].mkdir()
        save_trace(reqs, runs[-1] / "trace.jsonl")
        result = {k: predicted[k] * scale for k in VALIDATED}
        workers = [{"worker_id": "colocated-0", "role": "colocated", "cores": [0, 1]}]
        (runs[-1] / "compare.json").write_text(json.dumps({"configs": [{"name": "colocated", "result": result,
                                                                        "resources": {"workers": workers}}]}))
    argv = [sys.executable, "-m", "epdserve", "plan", "validate", "--compare-dir", *map(str, runs),
            "--calibration", str(cal), "--devices", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "spread  20%" in proc.stdout and "mean of 2 runs" in proc.stdout
    (validation,) = calibrate.load(cal)["validations"].values()
    ttft = validation["rows"][0]["p95_ttft_ms"]
    assert ttft["runs"] == pytest.approx([1.1 * predicted["p95_ttft_ms"], 0.9 * predicted["p95_ttft_ms"]])
    assert ttft["error"] == pytest.approx(0.0, abs=1e-9) and ttft["spread"] == pytest.approx(0.2)
    assert validation["max_spread"]["p95_itl_ms"] == pytest.approx(0.2)
    assert ttft["band"][0] < ttft["predicted"] < ttft["band"][1] and ttft["in_band"]
    assert validation["step_uncertainty"] == pytest.approx(0.1) and validation["in_band"] == validation["values"] == 2
    assert "holds 2 of 2 measured latencies" in proc.stdout
    doc = {"platform": "m on this CPU", "devices": 2, "workload": "w", "slos_ms": {"ttft": 100.0}, "target": 0.9,
           "candidates": [], "skipped": {}, "recommendation": None, "reason": "none", "validations": [validation]}
    text = markdown(doc)
    assert "largest |error| p95_ttft_ms 0%" in text and "moved by up to p95_ttft_ms 20%" in text
    assert "the prediction's band held 2 of 2 measured latencies" in text
    # A "repeat" of another trace is refused.
    save_trace(reqs[:-1], runs[1] / "trace.jsonl")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "replayed another trace" in proc.stderr and "Traceback" not in proc.stderr


def templated_platform() -> Platform:
    """10 ms + 1 ms per new token a step; prompts = text + 25 template tokens, the first 20
    the same in every prompt (one full 16-token block the prefix cache keeps)."""
    return Platform("tokens", step=lambda n: LinearStep((10.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1,),
                    kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0, router_ms=2.0,
                    template_tokens=25, template_prefix_tokens=20)


def test_the_template_prefix_is_prefilled_once_per_worker():
    # A (100 tokens) finds nothing: 110 ms. B comes after A's step: 84 new tokens over 16
    # cached, 94 ms.
    platform = templated_platform()
    reqs = [req(0.0, 75, 1), req(0.2, 75, 1)]
    records, stages = simulate(COLOCATED, platform, reqs)
    assert [s.prefill_ms for s in stages] == pytest.approx([110.0, 94.0])
    assert records[1].chunk_times_s == pytest.approx([0.096])
    # Admitted in the same step as A, C finds nothing either (blocks are cached once computed).
    _, stages = simulate(COLOCATED, platform, [req(0.0, 75, 1), req(0.0, 75, 1)])
    assert [s.prefill_ms for s in stages] == pytest.approx([210.0, 210.0])
    # Without prefix caching every prompt is computed whole.
    _, stages = simulate(COLOCATED, platform, reqs, EngineLimits(enable_prefix_caching=False))
    assert [s.prefill_ms for s in stages] == pytest.approx([110.0, 110.0])
    # PD: the prefill worker caches it the same way.
    _, stages = simulate(PD, platform, reqs)
    assert [s.prefill_ms for s in stages] == pytest.approx([110.0, 94.0])


def test_a_shared_document_is_prefilled_once_per_worker():
    # The texts are a 400-character document and their own 40 characters, 110 tokens each
    # (4 characters a token). B shares 401 characters with A: 100 tokens + the template's 20 =
    # 120, 112 in full blocks; it computes 135 - 112 = 23 tokens. C shares only the template.
    platform = templated_platform()
    doc = "abcd" * 100
    texts = [doc + " x" * 20, doc + " y" * 20, "efgh" * 100 + " y" * 20]
    reqs = [Request(0.3 * i, text, 1, "chat", 110) for i, text in enumerate(texts)]
    _, stages = simulate(COLOCATED, platform, reqs)
    assert [s.prefill_ms for s in stages] == pytest.approx([145.0, 33.0, 129.0])
    _, stages = simulate(COLOCATED, platform, reqs, EngineLimits(enable_prefix_caching=False))
    assert [s.prefill_ms for s in stages] == pytest.approx([145.0, 145.0, 145.0])


def test_calibration_times_each_prefill_in_one_step():
    """Whatever this machine's default step budget (512 tokens on 2 cores here), each prompt
    length calibrated is one step: the step model is of a step's tokens."""
    from epdserve.model.loader import resolve_model

    steps = calibrate._prefill_steps(str(resolve_model(None).path), 1, np.random.default_rng(0), [])
    assert [sum(s["prefill"][0]) for s in steps] == list(calibrate.PREFILL_LENS)
    assert all(s["ms"] > 0 for s in steps)
