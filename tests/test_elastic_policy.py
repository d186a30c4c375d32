"""The elastic controller's policy on handmade signal sequences.

The sequences come from small seeded workload models below (:func:`prefill_heavy`,
:func:`decode_heavy`, :func:`quiet`): per 2 s sample, the arrivals of the phase, and the
TTFTs, ITL gaps and worker counts a deployment with the current roles would show (a
prefill-heavy mix stalls the decodes of colocated workers; a decode-heavy mix overloads the
single decode worker of 1P1D). :func:`drive` runs the router's loop: sample, decide on the
last window, apply the roles (the switched workers report ``switching`` for one sample).
``python tests/test_elastic_policy.py`` rewrites tests/data/elastic/shift_2workers.jsonl, the
recorded trace that tests/test_elastic_replay.py replays.
"""

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from epdserve.serving.elastic.policy import PolicyConfig, PolicyState, Sample, decide, window
from epdserve.serving.elastic.samples import WorkerSignal

pytestmark = pytest.mark.elastic


CFG = PolicyConfig(slo_ttft_ms=2000.0, slo_tpot_ms=150.0)
INTERVAL = 2.0
COLOCATED2 = {"w0": "colocated", "w1": "colocated"}
P1D1 = {"w0": "prefill", "w1": "decode"}
RECORDED = Path(__file__).parent / "data" / "elastic" / "shift_2workers.jsonl"


def sample(t, roles, *, arrivals=(), itls=(), ttfts=(), queue=None, running=1, waiting=0,
           outstanding=1, kv=0.1, switching=(), computed=None):
    """A sample where every worker shows the same counts (``running`` etc. may be a dict by
    role, ``outstanding`` a dict by worker); times in ms. ``computed``: the prompt tokens
    each TTFT's prefill computed (None: not recorded, as in older traces)."""
    def per(value, key):
        return value.get(key, 0) if isinstance(value, dict) else value
    workers = tuple(WorkerSignal(w, r, w in switching, per(running, r), per(waiting, r),
                                 per(outstanding, w), kv) for w, r in roles.items())
    def ms(values):  # to 0.1 ms, as a trace would print them: keeps the recorded file small
        return tuple(round(x, 1) for x in values)
    return Sample(float(t), workers, tuple(arrivals), ms(ttfts),
                  ms(queue if queue is not None else [x / 2 for x in ttfts]), ms(itls),
                  tuple(round(computed) for _ in ttfts) if computed is not None else ())


def prefill_heavy(rng, t, roles, switching=()):
    """Long documents, short answers, 1 req/s: colocated workers' decodes stall behind the
    prefills (ITL gaps of ~400 ms among ~40 ms ones), split workers decode undisturbed."""
    colocated = "colocated" in roles.values()
    itls = [rng.uniform(350, 450) if colocated and rng.random() < 0.25 else rng.uniform(30, 50)
            for _ in range(30)]
    return sample(t, roles, arrivals=[(rng.randint(1400, 1560), 24) for _ in range(2)],
                  itls=itls, ttfts=[rng.uniform(600, 900) for _ in range(2)], running=2,
                  outstanding=2, switching=switching)


def decode_heavy(rng, t, roles, switching=()):
    """Short questions, long answers: 12 sequences decoding; one decode worker alone runs
    them at ~250 ms a token, every worker decoding at ~90 ms."""
    n_decoders = sum(r != "prefill" for r in roles.values())
    itl = 250 if n_decoders == 1 else 90
    return sample(t, roles, arrivals=[(rng.randint(40, 60), 300) for _ in range(2)],
                  itls=[rng.uniform(0.8, 1.2) * itl for _ in range(30)],
                  ttfts=[rng.uniform(100, 200) for _ in range(2)],
                  running={"colocated": 6, "decode": 12, "prefill": 0}, outstanding=6,
                  kv=0.5, switching=switching)


def quiet(rng, t, roles, switching=()):
    """One short request every 10 s, nothing outstanding at the samples."""
    arrivals = [(50, 20)] if int(t) % 10 == 0 else []
    return sample(t, roles, arrivals=arrivals, itls=[30.0] * (20 if arrivals else 0),
                  ttfts=[100.0] * len(arrivals), running=0, outstanding=0, kv=0.0,
                  switching=switching)


def drive(phases, roles, config=CFG, seed=0):
    """The controller loop over ``phases`` [(model, seconds)]: every 2 s a sample of the
    phase's model under the current roles, a decision on the last ``window_s`` of samples,
    its roles applied (the workers that change report ``switching`` in the next sample).
    Returns (samples, decisions)."""
    rng, samples, decisions, state, switching = random.Random(seed), [], [], PolicyState(), ()
    t = 0.0
    for model, seconds in phases:
        for _ in range(int(seconds / INTERVAL)):
            samples.append(model(rng, t, roles, switching))
            decision, state = decide(window(samples, config), state, config)
            decisions.append(decision)
            switching = tuple(w for w, r in (decision.roles or {}).items() if roles[w] != r)
            roles = decision.roles or roles
            t += INTERVAL
    return samples, decisions


def spanning(s, seconds=CFG.window_s / 2):
    """``s``'s events in a window that spans ``seconds`` (half a window: enough evidence):
    ``s``, then its workers every 2 s without further events."""
    return [s] + [replace(s, t=s.t + k * INTERVAL, arrivals=(), ttfts_ms=(), prefill_queue_ms=(),
                          itls_ms=(), prefill_tokens=()) for k in range(1, int(seconds / INTERVAL) + 1)]


def changes(decisions):
    return [d for d in decisions if d.roles is not None]


def test_prefill_heavy_interference_splits():
    _, decisions = drive([(prefill_heavy, 40)], COLOCATED2)
    [d] = changes(decisions)
    assert (d.action, d.roles) == ("to-pd", P1D1)
    assert "prefill can spare a worker -> 1P1D" in d.reason and "longest ITL gap" in d.reason
    assert d.signals["itl_p90_ms"] > 1.2 * 150 and d.signals["prompt_answer_ratio"] > 50
    assert d.t == CFG.window_s / 2  # the first window spanning half a window: evidence


def test_decode_heavy_goes_colocated():
    _, decisions = drive([(decode_heavy, 40)], P1D1)
    [d] = changes(decisions)
    assert (d.action, d.roles) == ("to-colocated", COLOCATED2)
    assert "decode-heavy" in d.reason and "ITL p90" in d.reason
    assert d.signals["answer_avg_tok"] == 300


def test_no_split_when_one_prefill_worker_could_not_keep_up():
    """Interference, and TTFT within the SLO, but the prompts arriving (2,960 tok/s) need
    3.7 workers at the measured 800 tok/s (400 tokens in 500 ms): 1P1D's one prefill worker
    would fall behind, so colocated holds."""
    d, _ = decide(spanning(sample(0, COLOCATED2, arrivals=[(1480, 24)] * 20, itls=[400.0] * 20,
                                  ttfts=[1000.0] * 4, computed=400, outstanding=2)),
                  PolicyState(), CFG)
    assert d.roles is None and "1 prefill worker(s) could not keep up" in d.reason
    assert d.signals["prefill_speed_tok_s"] == pytest.approx(800)
    assert d.signals["prefill_demand_tok_s"] == pytest.approx(1480 * 20 / 10)  # over 10 s


def test_split_when_one_prefill_worker_can_keep_up():
    d, _ = decide(spanning(sample(0, COLOCATED2, arrivals=[(1480, 24)] * 3, itls=[400.0] * 20,
                                  ttfts=[1000.0] * 4, computed=1400, outstanding=2)),
                  PolicyState(), CFG)
    assert d.roles == P1D1 and "prefill load 0.16 workers" in d.reason


def test_overloaded_prefill_of_1p1d_goes_colocated():
    """1P1D whose prefill worker gets 3.7 workers' worth of prompts: no decode worker to
    move, so every worker prefills again."""
    d, _ = decide(spanning(sample(0, P1D1, arrivals=[(1480, 24)] * 20, itls=[40.0] * 20,
                                  ttfts=[1800.0] * 4, computed=400, outstanding=2)),
                  PolicyState(), CFG)
    assert d.roles == COLOCATED2 and "no decode worker to spare" in d.reason
    assert "TTFT p90 1800 ms > 0.8 x TTFT SLO" in d.reason


def test_a_burst_of_arrivals_without_slow_first_tokens_keeps_1p1d():
    """The same load, but the TTFTs (1,000 ms) keep within 0.8 x the SLO: a burst, held."""
    d, _ = decide(spanning(sample(0, P1D1, arrivals=[(1480, 24)] * 20, itls=[40.0] * 20,
                                  ttfts=[1000.0] * 4, computed=400, outstanding=2)),
                  PolicyState(), CFG)
    assert d.roles is None and "1P1D kept" in d.reason


def test_the_window_extends_back_to_hold_enough_arrivals():
    """One arrival every 10 s: the last 20 s hold 2, so the window reaches back to the 8th
    last arrival (70 s); never past max_window_s (120 s)."""
    samples = [sample(t, COLOCATED2, arrivals=[(100, 10)] if t % 10 == 0 else []) for t in range(0, 300, 2)]
    kept = window(samples, CFG)
    assert sum(len(s.arrivals) for s in kept) == 8 and kept[0].t == 298 - 78
    busy = [sample(t, COLOCATED2, arrivals=[(100, 10)] * 3) for t in range(0, 300, 2)]
    assert window(busy, CFG)[0].t == 298 - 18  # 20 s hold plenty: the window as it is
    rare = [sample(t, COLOCATED2, arrivals=[(100, 10)] if t % 60 == 0 else []) for t in range(0, 300, 2)]
    assert window(rare, CFG)[0].t == 298 - 118  # 120 s at most


def test_a_window_longer_than_max_window_s_is_kept_whole():
    long = replace(CFG, window_s=200.0)
    rare = [sample(t, COLOCATED2, arrivals=[(100, 10)] if t % 60 == 0 else []) for t in range(0, 300, 2)]
    assert window(rare, long)[0].t == 298 - 198


def test_start_up_samples_before_the_workers_are_no_evidence():
    """Samples without both workers (start-up: none, then one) describe no roles: a pd start
    is not read as low load until half a window of samples shows its workers, idle."""
    empty = [replace(sample(t, P1D1), workers=()) for t in range(0, 20, 2)]
    one = [replace(sample(t, P1D1), workers=sample(t, P1D1).workers[:1]) for t in range(20, 30, 2)]
    idle = [sample(t, P1D1, running=0, outstanding=0, kv=0.0) for t in range(30, 36, 2)]
    d, _ = decide(empty + one + idle, PolicyState(), CFG)
    assert d.roles is None and "too little evidence: 4 s of settled samples" in d.reason, d.reason
    idle += [sample(t, P1D1, running=0, outstanding=0, kv=0.0) for t in range(36, 42, 2)]
    d, _ = decide(empty + one + idle, PolicyState(), CFG)
    assert (d.action, d.roles) == ("to-colocated", COLOCATED2) and "low load" in d.reason


def test_a_stall_that_breaks_no_tpot_is_not_interference():
    """A 3.3 s stall over 126-token answers adds ~26 ms to a 40 ms step: within a 150 ms TPOT,
    so a split would save no request (found by the closed-loop simulation of epdserve plan)."""
    d, _ = decide(spanning(sample(0, COLOCATED2, arrivals=[(750, 126)] * 6, itls=[40.0] * 30 + [3300.0],
                                  ttfts=[800.0] * 4, outstanding=2)),
                  PolicyState(), CFG)
    assert d.roles is None and "colocated: no interference" in d.reason
    d, _ = decide(spanning(sample(0, COLOCATED2, arrivals=[(750, 20)] * 6, itls=[40.0] * 30 + [3300.0],
                                  ttfts=[800.0] * 4, outstanding=2)),
                  PolicyState(), CFG)
    assert d.roles == P1D1 and "a stalled answer's TPOT ~205 ms" in d.reason


def test_low_load_goes_colocated_without_evidence():
    _, decisions = drive([(quiet, 40)], P1D1)
    [d] = changes(decisions)
    assert (d.action, d.roles) == ("to-colocated", COLOCATED2)
    assert "low load" in d.reason and d.signals["inflight_per_worker"] == 0
    assert d.t == CFG.window_s / 2  # not before the window spans half its length


def test_shift_follows_the_phases_and_dwells():
    """Prefill-heavy -> decode-heavy -> prefill-heavy -> quiet: split, colocate, split,
    colocate, each change at least min_dwell_s after the previous one."""
    _, decisions = drive([(prefill_heavy, 60), (decode_heavy, 60), (prefill_heavy, 60),
                          (quiet, 60)], COLOCATED2)
    done = changes(decisions)
    assert [d.action for d in done] == ["to-pd", "to-colocated", "to-pd", "to-colocated"]
    assert all(b.t - a.t >= CFG.min_dwell_s for a, b in zip(done, done[1:]))
    dwelt = [d for d in decisions if "min dwell" in d.reason]
    assert dwelt and all(d.roles is None for d in dwelt)


def test_holds_during_dwell_then_acts():
    rng = random.Random(1)
    window = [decode_heavy(rng, t, P1D1) for t in range(100, 120, 2)]
    held, state = decide(window, PolicyState(last_switch_t=95.0), CFG)
    assert held.roles is None and held.reason == "23.0 s since the last change < min dwell 30 s"
    assert state == PolicyState(last_switch_t=95.0)
    acted, state = decide(window, PolicyState(last_switch_t=80.0), CFG)
    assert acted.action == "to-colocated" and state == PolicyState(last_switch_t=118.0)


def test_holds_while_a_worker_switches():
    rng = random.Random(2)
    window = [decode_heavy(rng, t, P1D1) for t in range(0, 20, 2)]
    window[-1] = decode_heavy(rng, 18, P1D1, switching=("w1",))
    d, _ = decide(window, PolicyState(), CFG)
    assert (d.roles, d.reason) == (None, "w1 still switching")


def test_samples_before_the_change_settled_are_not_used():
    """Interference measured while colocated says nothing about the split that followed."""
    rng = random.Random(3)
    before = [prefill_heavy(rng, t, COLOCATED2) for t in range(2, 10, 2)]
    after = [prefill_heavy(rng, t, P1D1) for t in range(10, 22, 2)]
    d, _ = decide(before + after, PolicyState(last_switch_t=9.0), replace(CFG, min_dwell_s=10))
    assert d.roles is None and d.signals["itl_p90_ms"] < 60 and d.signals["span_s"] == 10


def test_window_without_evidence_holds():
    thin = sample(0, COLOCATED2, arrivals=[(1500, 20)] * 2, itls=[400.0] * 19, outstanding=2)
    d, _ = decide(spanning(thin), PolicyState(), CFG)
    assert d.roles is None
    assert d.reason == "too little evidence: 2 arrivals < 3 and 19 ITL gaps < 20"


def test_a_window_shorter_than_half_a_window_holds():
    """After a long drain only a few seconds of the new roles' samples are settled: not a
    measurement, however loud."""
    rng = random.Random(5)
    window = [prefill_heavy(rng, t, COLOCATED2) for t in range(100, 120, 2)]
    window[:7] = [prefill_heavy(rng, t, COLOCATED2, switching=("w1",)) for t in range(100, 114, 2)]
    d, _ = decide(window, PolicyState(last_switch_t=88.0), CFG)
    assert d.roles is None and d.reason == "too little evidence: 4 s of settled samples < 10 s"
    assert d.signals["arrivals"] == 6 and d.signals["itl_p90_ms"] > 300


def test_itl_gaps_alone_are_evidence_but_not_of_the_mix():
    """20 gaps are evidence, but splitting needs the mix of >= 3 arrivals."""
    s = sample(0, COLOCATED2, arrivals=[(1500, 20)] * 2, itls=[400.0] * 20, outstanding=2)
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.roles is None and d.reason.startswith("colocated: no interference")
    s3 = sample(0, COLOCATED2, arrivals=[(1500, 20)] * 3, itls=[400.0] * 20, outstanding=2)
    assert decide(spanning(s3), PolicyState(), CFG)[0].action == "to-pd"


def test_reason_names_the_numbers():
    s = sample(0, COLOCATED2, arrivals=[(1480, 24)] * 3, itls=[412.0] * 20, outstanding=2)
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.reason == ("longest ITL gap 412 ms > 2 x TPOT SLO 150 ms (a stalled answer's TPOT ~429 ms) at decode "
                        "batch 1.0 < 4 while "
                        "prompts avg 1480 tok / answers 24 tok (61.7x) >= 4x: prefill "
                        "interference; TTFT p90 0 ms <= 0.8 x TTFT SLO: prefill can spare a worker -> 1P1D")


def test_interference_with_no_ttft_slack_holds():
    """A split takes a worker from prefill: with the TTFT p90 over 0.8 x its SLO it would
    trade the stalls for missed first tokens, so the policy holds and says why."""
    s = sample(0, COLOCATED2, arrivals=[(1480, 24)] * 3, itls=[412.0] * 20, ttfts=[1900.0] * 3, outstanding=2)
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.roles is None and d.reason.endswith(
        "but TTFT p90 1900 ms > 0.8 x TTFT SLO 2000 ms: no prefill capacity to spare for a split")


def test_decode_heavy_itl_over_the_slo_at_a_small_batch_goes_colocated():
    """Short prompts leave no prefill to blame: a slow decode worker is decode load."""
    s = sample(0, P1D1, arrivals=[(60, 300)] * 3, itls=[200.0] * 40, running={"decode": 2})
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.action == "to-colocated"
    assert d.reason == ("ITL p90 200 ms > 1.2 x TPOT SLO 150 ms at decode batch 2.0 while "
                        "prompts avg 60 tok / answers 300 tok (0.2x) <= 2x: decode-heavy "
                        "-> colocated")
    quick = sample(0, P1D1, arrivals=[(60, 300)] * 3, itls=[100.0] * 40, running={"decode": 2})
    assert decide(spanning(quick), PolicyState(), CFG)[0].roles is None  # within the SLO: 1P1D is fine


def test_big_batch_itl_is_not_interference():
    """Colocated ITL over the SLO with big batches is decode load: splitting would not help."""
    s = sample(0, COLOCATED2, arrivals=[(1480, 24)] * 3, itls=[400.0] * 20, running=6,
               outstanding=6)
    assert decide(spanning(s), PolicyState(), CFG)[0].roles is None


# --- xPyD rebalancing ------------------------------------------------------------------------

def test_prefill_pressure_moves_the_least_busy_decode_worker_n3():
    roles = {"w9": "prefill", "w10": "decode", "w11": "decode"}
    s = sample(0, roles, arrivals=[(300, 100)] * 4, ttfts=[3000.0] * 4, itls=[60.0] * 40,
               running=3, outstanding={"w9": 4, "w10": 3, "w11": 2})
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.action == "rebalance"
    assert d.roles == {"w9": "prefill", "w10": "decode", "w11": "prefill"}
    assert d.reason.startswith("TTFT p90 3000 ms > 1 x TTFT SLO 2000 ms while decode has slack")
    assert d.reason.endswith("prefill pressure -> w11 decode -> prefill (2P1D)")


def test_prefill_queue_is_prefill_pressure():
    roles = {"w0": "prefill", "w1": "decode", "w2": "decode"}
    s = sample(0, roles, arrivals=[(300, 100)] * 4, ttfts=[1500.0] * 4, queue=[1200.0] * 4,
               itls=[60.0] * 40)
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.action == "rebalance" and d.reason.startswith("prefill queue p90 1200 ms > 0.5 x")


def test_decode_pressure_moves_a_prefill_worker_n4():
    roles = {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode"}
    s = sample(0, roles, arrivals=[(1000, 100)] * 4, ttfts=[800.0] * 4, itls=[250.0] * 40,
               running={"decode": 6}, outstanding={"w0": 2, "w1": 1, "w2": 6, "w3": 6})
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert (d.action, d.roles) == ("rebalance", {"w0": "prefill", "w1": "decode", "w2": "decode",
                                                 "w3": "decode"})
    assert "decode pressure -> w1 prefill -> decode (1P3D)" in d.reason


def test_decode_waiting_is_decode_pressure_but_not_without_prefill_slack():
    roles = {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode"}
    busy = sample(0, roles, arrivals=[(1000, 100)] * 4, ttfts=[1900.0] * 4, itls=[100.0] * 40,
                  waiting={"decode": 1})
    d, _ = decide(spanning(busy), PolicyState(), CFG)
    assert d.roles is None and "2.0 requests waiting on decode" in d.reason  # TTFT 1900 > 0.8 x SLO
    slack = sample(0, roles, arrivals=[(1000, 100)] * 4, ttfts=[900.0] * 4, itls=[100.0] * 40,
                   waiting={"decode": 1})
    assert decide(spanning(slack), PolicyState(), CFG)[0].action == "rebalance"


def test_decode_pressure_with_one_prefill_worker():
    """x = 1: colocated adds decode capacity, but only for a decode-heavy mix (long prompts
    would bring interference back)."""
    roles = {"w0": "prefill", "w1": "decode", "w2": "decode"}
    long = sample(0, roles, arrivals=[(1000, 100)] * 4, ttfts=[800.0] * 4, itls=[250.0] * 40,
                  running={"decode": 6})
    d, _ = decide(spanning(long), PolicyState(), CFG)
    assert d.roles is None and d.reason.startswith("1P2D kept")
    short = sample(0, roles, arrivals=[(100, 200)] * 4, ttfts=[800.0] * 4, itls=[250.0] * 40,
                   running={"decode": 6})
    d, _ = decide(spanning(short), PolicyState(), CFG)
    assert d.action == "to-colocated" and set(d.roles.values()) == {"colocated"}


def test_colocated_n3_splits_2p1d():
    roles = {"w0": "colocated", "w1": "colocated", "w2": "colocated"}
    s = sample(0, roles, arrivals=[(1480, 24)] * 3, itls=[400.0] * 20, outstanding=2)
    d, _ = decide(spanning(s), PolicyState(), CFG)
    assert d.roles == {"w0": "prefill", "w1": "prefill", "w2": "decode"}
    assert d.reason.endswith("-> 2P1D")


@pytest.mark.parametrize("roles, reason", [
    ({"w0": "colocated"}, "1 live worker(s): a split needs >= 2"),
    ({"w0": "colocated", "w1": "decode"},
     "roles 1 colocated / 0 prefill / 1 decode are neither all colocated nor xPyD"),
    ({"w0": "decode", "w1": "decode"},
     "roles 0 colocated / 0 prefill / 2 decode are neither all colocated nor xPyD"),
])
def test_holds_on_layouts_it_does_not_choose_between(roles, reason):
    d, _ = decide(spanning(sample(0, roles, arrivals=[(1480, 24)] * 3, itls=[400.0] * 20)),
                  PolicyState(), CFG)
    assert (d.roles, d.reason) == (None, reason)


# --- no flapping ---------------------------------------------------------------------------

def noisy(center, amp, rng):
    return center * (1 + amp * rng.uniform(-1, 1))


def scenario(name, amp):
    """A role-independent (worst case: the deployment does not respond to the change) signal
    with one quantity oscillating around a threshold by ±amp of itself; the start roles."""
    def model(rng, t, roles, switching=()):
        itl, ratio, inflight, ttft, running, computed = 400.0, 60.0, 1.0, 800.0, 1, None
        if name == "itl@interference":
            itl = noisy(300.0, amp, rng)  # the stall threshold: 2 x the TPOT SLO
        elif name == "ratio@split":
            ratio = noisy(4.0, amp, rng)
        elif name == "ratio@colocate":
            ratio, running, itl = noisy(2.0, amp, rng), 6, 60.0
        elif name == "inflight@low":
            inflight = noisy(0.2, amp, rng)
        elif name == "inflight@split":
            inflight = noisy(0.4, amp, rng)
        elif name == "load@split":
            # 1,440 prompt tok/s over a 400 ms prefill (TTFT 800 less queue 400) of N tokens:
            # a load of 576 / N workers, around 0.7 x the 2 prefill workers of a 2P2D split.
            computed = 576 / noisy(1.4, amp, rng)
        elif name == "ttft@slo":
            ttft, itl = noisy(2000.0, amp, rng), 60.0
        elif name == "itl@decode":
            ttft, itl, running = 900.0, noisy(180.0, amp, rng), 6
        out = 4 * inflight  # over 4 workers, rounded at random: its mean is 4 x inflight
        total = int(out) + (rng.random() < out % 1)
        return sample(t, roles, arrivals=[(round(24 * ratio), 24)] * 2, itls=[itl] * 20,
                      ttfts=[ttft] * 2, running=running, computed=computed,
                      outstanding={f"w{i}": total // 4 + (i < total % 4) for i in range(4)},
                      switching=switching)
    start = {"itl@interference": "co", "ratio@split": "co", "inflight@split": "co",
             "load@split": "co"}.get(name, "pd")
    roles = ({f"w{i}": "colocated" for i in range(4)} if start == "co" else
             {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode"})
    return model, roles


SCENARIOS = ["itl@interference", "ratio@split", "ratio@colocate", "inflight@low",
             "inflight@split", "ttft@slo", "itl@decode", "load@split"]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(name=st.sampled_from(SCENARIOS), amp=st.floats(0.0, 0.3), seed=st.integers(0, 2**16))
def test_noise_around_a_threshold_does_not_flap(name, amp, seed):
    """Five minutes of a signal oscillating around one threshold: at most one change."""
    model, roles = scenario(name, amp)
    _, decisions = drive([(model, 300)], roles, seed=seed)
    assert len(changes(decisions)) <= 1, [d.reason for d in changes(decisions)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_threshold_is_crossed_by_its_scenario(name):
    """The no-flap property is not vacuous: at ±30 % each scenario does change the roles."""
    model, roles = scenario(name, 0.3)
    _, decisions = drive([(model, 300)], roles)
    assert len(changes(decisions)) == 1


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(n=st.integers(2, 4), start_x=st.integers(0, 3), itl=st.floats(20, 600),
       ratio=st.floats(0.1, 80), inflight=st.sampled_from([0.0, 0.2, 0.3, 0.6, 1.0, 3.0]),
       ttft=st.floats(100, 5000), queue_share=st.floats(0, 1), running=st.integers(0, 10),
       waiting=st.integers(0, 3), kv=st.floats(0, 1))
def test_a_steady_signal_never_revisits_a_configuration(n, start_x, itl, ratio, inflight, ttft,
                                                        queue_share, running, waiting, kv):
    """Whatever the levels, a signal that stays put (and, worst case, does not respond to the
    roles) moves the roles one way only: no configuration comes back."""
    ids = [f"w{i}" for i in range(n)]
    x = min(start_x, n - 1)
    roles = {w: "colocated" if x == 0 else "prefill" if i < x else "decode"
             for i, w in enumerate(ids)}
    per_worker = {w: int(inflight) + (i < round((inflight % 1) * n)) for i, w in enumerate(ids)}

    def steady(rng, t, roles, switching=()):
        return sample(t, roles, arrivals=[(round(24 * ratio), 24)] * 2, itls=[itl] * 20,
                      ttfts=[ttft] * 2, queue=[ttft * queue_share] * 2, running=running,
                      waiting=waiting, outstanding=per_worker, kv=kv, switching=switching)
    _, decisions = drive([(steady, 300)], roles)
    seen = [tuple(sorted(roles.items()))] + [tuple(sorted(d.roles.items()))
                                             for d in changes(decisions)]
    assert len(seen) == len(set(seen)), [d.reason for d in changes(decisions)]


# --- determinism, serialization, config ------------------------------------------------------

def test_decisions_are_deterministic():
    phases = [(prefill_heavy, 60), (decode_heavy, 60), (quiet, 40)]
    samples, first = drive(phases, COLOCATED2, seed=7)
    _, second = drive(phases, COLOCATED2, seed=7)
    assert first == second
    state = PolicyState()
    again = []
    for i, s in enumerate(samples):
        d, state = decide(window(samples[:i + 1], CFG), state, CFG)
        again.append(d)
    assert again == first


def test_sample_round_trip_through_json():
    samples, _ = drive([(prefill_heavy, 10), (decode_heavy, 10)], COLOCATED2, seed=3)
    for s in samples:
        assert Sample.from_json(json.loads(json.dumps(s.as_json()))) == s


GOOD = sample(1.5, P1D1, arrivals=[(10, 5)], itls=[1.0], ttfts=[2.0]).as_json()


@pytest.mark.parametrize("change, message", [
    (lambda o: o.pop("workers"), r"^sample: missing keys \['workers'\]$"),
    (lambda o: o.update(extra=1), r"^sample: unknown keys \['extra'\]$"),
    (lambda o: o["workers"][0].pop("kv_usage"), r"^worker: missing keys \['kv_usage'\]$"),
    (lambda o: o.update(t="now"), r"sample t: expected a finite number, got 'now'"),
    (lambda o: o.update(itls_ms=[1.0, -2.0]), r"itls_ms: expected a finite number >= 0, got -2.0"),
    (lambda o: o.update(ttfts_ms=5), r"'ttfts_ms' must be a list, got 5"),
    (lambda o: o.update(arrivals=[[1, 2, 3]]), r"arrival: expected \[prompt tokens, max_tokens\]"),
    (lambda o: o.update(arrivals=[[1.5, 2]]), r"arrival prompt tokens: expected an integer >= 0"),
    (lambda o: o["workers"][0].update(role="encode"), r"worker w0: role 'encode' is not one of"),
    (lambda o: o["workers"][0].update(kv_usage=1.5), r"worker w0 kv_usage: expected 0..1, got 1.5"),
    (lambda o: o["workers"][0].update(switching=1), r"worker w0: switching must be true or false"),
    (lambda o: o["workers"][1].update(num_running=-1), r"worker w1 num_running: expected an int"),
    (lambda o: o["workers"][1].update(worker_id=""), r"worker_id must be a non-empty string"),
    (lambda o: o.update(workers={}), r"'workers' and 'arrivals' must be lists"),
])
def test_malformed_sample_raises_value_error(change, message):
    obj = json.loads(json.dumps(GOOD))
    change(obj)
    with pytest.raises(ValueError, match=message):
        Sample.from_json(obj)


def test_sample_from_non_object():
    with pytest.raises(ValueError, match="sample: expected a JSON object, got list"):
        Sample.from_json([])


@pytest.mark.parametrize("kwargs, message", [
    ({"slo_tpot_ms": 0.0}, "slo_tpot_ms: expected a finite number > 0, got 0.0"),
    ({"min_dwell_s": 0.0}, "min_dwell_s: expected a finite number > 0, got 0.0"),
    ({"quantile": 1.5}, "quantile: expected 0 < q <= 1"),
    ({"itl_slack": 1.3}, r"itl_enter 1.2 must be > itl_slack 1.3 \(a hysteresis band\)"),
    ({"low_load_leave": 0.1}, "low_load_leave 0.1 must be > low_load_enter 0.2"),
    ({"split_util": 0.95}, "overload_util 0.9 must be > split_util 0.95"),
    ({"window_arrivals": -1}, "window_arrivals: expected an integer >= 0, got -1"),
])
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**{"slo_ttft_ms": 2000.0, "slo_tpot_ms": 150.0, **kwargs})


def test_decide_needs_a_sample():
    with pytest.raises(ValueError, match="no samples"):
        decide([], PolicyState(), CFG)


# --- the recorded trace of tests/test_elastic_replay.py --------------------------------------

def record(path: Path) -> None:
    """Write the shift run of :func:`test_shift_follows_the_phases_and_dwells` as a router
    trace: ``role`` events, ``elastic_sample`` and ``elastic_decision`` lines and a request
    record (which the replay must ignore), in the contract's format (``at`` = 1.8e9 + t)."""
    samples, decisions = drive([(prefill_heavy, 60), (decode_heavy, 60), (prefill_heavy, 60),
                                (quiet, 60)], COLOCATED2)
    lines = [{"event": "role", "at": 1.8e9, "worker": w, "role": r, "previous": None,
              "state": "up", "drain_ms": None, "reason": None} for w, r in COLOCATED2.items()]
    for s, d in zip(samples, decisions):
        lines.append({"event": "elastic_sample", "at": 1.8e9 + s.t, "sample": s.as_json()})
        if d.roles is not None:
            lines.append({"event": "elastic_decision", "at": 1.8e9 + d.t, "action": d.action,
                          "roles": d.roles, "reason": d.reason, "signals": d.signals})
        if s.t == 30.0:
            lines.append({"request_id": "cmpl-1", "path": "colocated", "ttft_ms": 812.0})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))


if __name__ == "__main__":
    record(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDED)
