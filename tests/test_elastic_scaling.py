"""The elastic scaling policy (``serve --elastic --max-workers N``) on
recorded signal sequences, in process.

The sequences come from a small seeded load model (:func:`loaded`): a total demand of
requests in flight spread evenly over the live workers, each running up to 4 of them and
queueing the rest; TTFTs grow with the queue. :func:`drive` runs the router's loop: every
2 s a sample, a decision on the last window, a worker added (up 2 samples later) or
retired (gone 1 sample later; both count as ``changing`` meanwhile)."""

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from epdserve.serving.elastic.policy import Sample
from epdserve.serving.elastic.scaling import ScalingConfig, ScalingState, decide_scale
from epdserve.serving.elastic.samples import WorkerSignal

pytestmark = pytest.mark.elastic

CFG = ScalingConfig(min_workers=2, max_workers=4, slo_ttft_ms=2000.0, slo_tpot_ms=200.0)
INTERVAL = 2.0
SLOTS = 4  # sequences a worker runs at once in the model


def loaded(rng, t, workers, demand, noise=0.0):
    """``workers`` (id -> role) sharing ``demand`` requests in flight (x a uniform factor
    within +-``noise``): per worker min(share, SLOTS) running, the rest waiting; a TTFT of
    400 ms x (1 + waiting) per arrival (2 a sample), ITL gaps of 60 ms."""
    share = demand * (1 + rng.uniform(-noise, noise)) / max(len(workers), 1)
    running, waiting = min(share, SLOTS), max(0.0, share - SLOTS)
    sig = tuple(WorkerSignal(w, r, False, int(running), int(round(waiting)), int(round(share)), 0.1)
                for w, r in workers.items())
    ttft = 400.0 * (1 + waiting)
    return Sample(t, sig, ((100, 50),) * 2, (ttft, ttft), (ttft / 2, ttft / 2), (60.0,) * 20)


def drive(phases, n_start=2, config=CFG, noise=0.0, seed=0):
    """The loop over ``phases`` [(demand, seconds)]; returns (decisions, live counts)."""
    rng, samples, decisions, counts = random.Random(seed), [], [], []
    workers = {f"worker-{i}": "colocated" for i in range(n_start)}
    state, starting, retiring, t, nxt = ScalingState(), {}, {}, 0.0, n_start
    for demand, seconds in phases:
        for _ in range(int(seconds / INTERVAL)):
            for wid, due in list(starting.items()):
                if t >= due:
                    workers[wid] = "colocated"
                    del starting[wid]
            for wid, due in list(retiring.items()):
                if t >= due:
                    del retiring[wid]
            samples.append(loaded(rng, t, workers, demand, noise))
            window = [s for s in samples if s.t > t - config.window_s]
            d, state = decide_scale(window, state, config, changing=len(starting) + len(retiring))
            decisions.append(d)
            if d.action == "scale-out":
                starting[f"worker-{nxt}"] = t + 2 * INTERVAL
                nxt += 1
            elif d.action == "scale-in":
                del workers[d.worker_id]
                retiring[d.worker_id] = t + INTERVAL
            counts.append(len(workers) + len(starting))
            t += INTERVAL
    return decisions, counts


def changes(decisions):
    return [d for d in decisions if d.action != "hold"]


def test_sustained_saturation_scales_out_to_the_maximum_and_no_further():
    decisions, counts = drive([(40, 200)])
    done = changes(decisions)
    assert [d.action for d in done] == ["scale-out", "scale-out"] and max(counts) == CFG.max_workers
    assert all(d.role == "colocated" for d in done)
    first = done[0]
    assert "TTFT p90" in first.reason and "saturated" in first.reason and "add a colocated worker" in first.reason
    assert first.signals["ttft_p90_ms"] > CFG.slo_ttft_ms and first.signals["live_workers"] == 2
    assert first.t >= CFG.evidence_s  # a whole window of evidence first
    assert all(b.t - a.t >= CFG.min_dwell_s for a, b in zip(done, done[1:]))
    assert any("at max 4" in d.reason for d in decisions[-5:])


def test_low_load_scales_in_to_the_minimum_and_no_further():
    decisions, counts = drive([(0.2, 200)], n_start=4)
    done = changes(decisions)
    assert [(d.action, d.worker_id) for d in done] == [("scale-in", "worker-3"), ("scale-in", "worker-2")]
    assert min(counts) == CFG.min_workers and "in flight per worker" in done[0].reason
    assert any("idle but at min 2" in d.reason for d in decisions[-5:])


def test_a_burst_then_a_lull_scales_out_then_in():
    decisions, counts = drive([(0.2, 40), (40, 100), (0.2, 160)])
    assert [d.action for d in changes(decisions)] == ["scale-out", "scale-out", "scale-in", "scale-in"]
    assert counts[-1] == 2 and max(counts) == 4


def test_a_short_burst_is_noise():
    """Saturation for less than the window (10 s): nothing added."""
    decisions, _ = drive([(0.2, 40), (40, 10), (1.5, 60)])
    assert changes(decisions) == []


def split_sample(t, running_decode, itl_ms, waiting_prefill=0):
    workers = (WorkerSignal("worker-0", "prefill", False, 0, waiting_prefill, 1, 0.1),
               WorkerSignal("worker-1", "decode", False, running_decode, 0, running_decode, 0.5))
    return Sample(t, workers, ((100, 300),) * 2, (500.0,), (100.0,), (itl_ms,) * 30)


def test_decode_saturation_in_a_split_adds_a_decode_worker():
    samples = [split_sample(t, 8, 400.0) for t in range(0, 20, 2)]
    d, state = decide_scale(samples, ScalingState(), CFG)
    assert (d.action, d.role) == ("scale-out", "decode") and "ITL p90 400 ms" in d.reason
    assert state.last_change_t == samples[-1].t
    # A small batch with the same gaps is not saturation (a prefill stall, the role policy's business).
    d, _ = decide_scale([split_sample(t, 2, 400.0) for t in range(0, 20, 2)], ScalingState(), CFG)
    assert d.action == "hold"


def test_holds_while_anything_changes_and_within_the_dwell():
    samples = [split_sample(t, 8, 400.0) for t in range(0, 20, 2)]
    d, _ = decide_scale(samples, ScalingState(), CFG, changing=1)
    assert d.action == "hold" and "starting or retiring" in d.reason
    d, _ = decide_scale(samples, ScalingState(last_change_t=0.0), CFG)
    assert d.action == "hold" and "min dwell" in d.reason
    d, _ = decide_scale(samples, ScalingState(), CFG, role_change_t=5.0)
    assert d.action == "hold" and "min dwell" in d.reason
    with pytest.raises(ValueError, match="no samples"):
        decide_scale([], ScalingState(), CFG)


@pytest.mark.parametrize("kw,message", [
    ({"min_workers": 0}, "min_workers"), ({"max_workers": 1}, "max_workers"),
    ({"slo_ttft_ms": 0}, "slo_ttft_ms"), ({"idle_enter": 2.0}, "hysteresis band"),
])
def test_bad_config_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**{"min_workers": 2, "max_workers": 4, "slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0, **kw})


@settings(max_examples=80, deadline=None)
@given(level=st.floats(0.0, 60.0), noise=st.floats(0.0, 0.5), n_start=st.integers(2, 4),
       seed=st.integers(0, 2**16))
def test_noise_at_any_level_never_flaps_nor_leaves_the_bounds(level, noise, n_start, seed):
    """A steady demand (+-50 % noise per sample) for 5 minutes: the count moves in one
    direction at most, stays within [min, max], and every change is min_dwell_s apart."""
    decisions, counts = drive([(level, 300)], n_start=n_start, noise=noise, seed=seed)
    done = changes(decisions)
    assert len({d.action for d in done}) <= 1, [(d.t, d.action, d.reason) for d in done]
    assert all(CFG.min_workers <= c <= CFG.max_workers for c in counts)
    assert all(b.t - a.t >= CFG.min_dwell_s for a, b in zip(done, done[1:]))
    assert all(math.isfinite(v) for d in done for v in d.signals.values())
