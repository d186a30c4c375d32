"""The planner: cost model, simulator, search and CLI, on hand-computable cases."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from epdserve.bench import metrics
from epdserve.plan import hardware, search
from epdserve.plan.costmodel import LinearStep, Link, Platform, Roofline, roofline_platform
from epdserve.plan.model_spec import BUILTIN
from epdserve.plan.run import compare_deployment
from epdserve.bench.workload import Request
from epdserve.plan.simulate import Deployment, EngineLimits, WorkerSpec, simulate

COLOCATED = Deployment("colocated", (WorkerSpec("colocated"),))
PD = Deployment("1p1d", (WorkerSpec("prefill"), WorkerSpec("decode")))


def req(offset_s: float, prompt_tokens: int, max_tokens: int, kind: str = "chat") -> Request:
    return Request(offset_s, "", max_tokens, kind, prompt_tokens)


def flat_platform(step_ms: float = 10.0, per_seq_ms: float = 0.0, link_ms: float = 5.0) -> Platform:
    """Every step costs step_ms + per_seq_ms per sequence; the hand-off a fixed link_ms."""
    return Platform("flat", step=lambda n: LinearStep((step_ms, per_seq_ms, 0.0, 0.0, 0.0)), worker_sizes=(1,),
                    kv_bytes_per_token=1000, kv_link=Link(gbs=1e9, latency_ms=link_ms),
                    price_per_device_hour=1.0, router_ms=2.0)


def test_colocated_single_request_times():
    records, stages = simulate(COLOCATED, flat_platform(), [req(0.0, 5, 4)])
    r = records[0]
    # router 2 ms, prefill step 10 ms -> token 1; then one 10 ms decode step per token.
    assert r.chunk_times_s == pytest.approx([0.012, 0.022, 0.032, 0.042])
    assert stages[0]["prefill_ms"] == pytest.approx(10.0)
    assert stages[0]["colocated_queue_ms"] == pytest.approx(0.0)


def test_pd_single_request_times():
    records, stages = simulate(PD, flat_platform(), [req(0.0, 5, 3)])
    # token 1 at 2 + 10 ms; KV link 5 ms; decode steps of 10 ms for tokens 2 and 3.
    assert records[0].chunk_times_s == pytest.approx([0.012, 0.027, 0.037])
    assert stages[0]["kv_transfer_ms"] == pytest.approx(5.0, rel=1e-6)
    assert stages[0]["kv_bytes"] == 5000


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
    # A 1,000-token prompt at 1 ms/token arrives while a chat request decodes.
    platform = Platform("tokens", step=lambda n: LinearStep((10.0, 0.0, 1.0, 0.0, 0.0)), worker_sizes=(1,),
                        kv_bytes_per_token=10, kv_link=Link(1e9, 1.0), price_per_device_hour=1.0)
    reqs = [req(0.0, 10, 40), req(0.1, 1000, 2, kind="long")]
    colocated, _ = simulate(COLOCATED, platform, reqs)
    pd, _ = simulate(PD, platform, reqs)
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
    assert compare_deployment("pd", 2) == Deployment("pd", (WorkerSpec("prefill", 1), WorkerSpec("decode", 1)))
    assert compare_deployment("colocated", 2).workers == (WorkerSpec("colocated", 2),)
    with pytest.raises(ValueError, match="share cores"):
        compare_deployment("2p2d", 2)


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


def test_roofline_plan_cli(tmp_path):
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--hardware", "H200", "--model",
                           "Llama-3.1-8B", "--devices", "2", "--input-len", "1000:1000", "--output-len",
                           "100:100", "--num-requests", "60", "--slo", "ttft:500", "tpot:30",
                           "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "**Recommendation:" in proc.stdout
    assert (out / "plan.json").is_file() and (out / "goodput.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "TPU9"], "unknown hardware 'TPU9'"),
    (["--target", "1.5"], "--target 1.5"),
    (["validate", "--calibration", "/nonexistent/cal.json", "--compare-dir", "/tmp"], "epdserve plan calibrate"),
])
def test_plan_cli_errors(argv, message):
    proc = subprocess.run([sys.executable, "-m", "epdserve", "plan", "--model", "Llama-3.1-8B", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
