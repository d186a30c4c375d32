"""The recommendation rules (epdserve/bench/recommend.py) on hand-made compare entries and
on results computed from hand-made client records."""

import pytest

from epdserve.bench import report
from epdserve.bench.client import RequestRecord
from epdserve.bench.metrics import compute
from epdserve.bench.recommend import recommend
from epdserve.bench.rules import cannot_tell_apart, figures
from epdserve.bench.repeats import combine

SLOS = {"ttft": 2000.0, "tpot": 200.0}


def entry(name, mode="colocated", *, ttft95=1000.0, itl50=100.0, itl95=200.0, itl99=400.0,
          tput=20.0, goodput=0.5, cores=2, failed=0, completed=20, stalls=0, handoff=None,
          e2el50=5000.0):
    """A compare entry measured with --goodput SLOS, with the fields the rules read (ms,
    tok/s, req/s)."""
    e = {"name": name, "mode": mode,
         "result": {"p95_ttft_ms": ttft95, "mean_ttft_ms": ttft95 / 2, "median_itl_ms": itl50,
                    "p95_itl_ms": itl95, "p99_itl_ms": itl99, "output_throughput": tput,
                    "median_e2el_ms": e2el50,
                    "request_goodput": goodput, "slo_attainment": goodput and 0.9,
                    "goodput_slos_ms": SLOS, "completed": completed, "failed": failed},
         "resources": {"num_cores": cores},
         "itl_stalls": stalls,
         "breakdown": {"ttft": {"n": 20, "parts": ["router", "prefill", "other"],
                                "mean": {"router": 5.0, "prefill": 350.0, "other": 145.0},
                                "p95": {"router": 9.0, "prefill": 900.0, "other": 300.0}},
                       "handoff": handoff}}
    if mode == "pd":
        e["server"] = {"mean_kv_bytes": 16e6}
    return e


GAP = {"n": 20, "parts": ["KV import", "first decode step", "other"],
       "mean": {"KV import": 10.0, "first decode step": 109.0, "other": 1.0},
       "p95": {"KV import": 20.0, "first decode step": 200.0, "other": 2.0}}


def stream(i: int, ttft: float, gap: float, freeze: float = 0.0) -> RequestRecord:
    """Request i, sent at i s: 21 chunks from ``ttft``, ``gap`` apart, the 10th gap
    ``freeze`` longer (s)."""
    times = [ttft + gap * k + (freeze if k >= 10 else 0.0) for k in range(21)]
    return RequestRecord(index=i, start_s=float(i), chunk_times_s=times, last_chunk_s=times[-1],
                         end_s=i + times[-1], usage_completion_tokens=21, request_id=str(i),
                         success=True)


def measured(name, mode, records, slos=None):
    """A compare entry whose result comes from the client records, as bench computes it,
    with its per-request outcomes (as repeats.combine keeps them)."""
    return combine([{"name": name, "mode": mode, "result": compute(records, slos),
                     "resources": {"num_cores": 2}, "itl_stalls": 0}])


def frozen_colocated_and_slow_pd(slos=None):
    """colocated: TTFT 0.5 s, but 5 of 10 streams freeze for 2 s (TPOT still ~150 ms); pd:
    TTFT 1.5 s (3x worse at p50), no freeze."""
    colocated = [stream(i, 0.5, 0.05, 2.0 if i % 2 else 0.0) for i in range(10)]
    pd = [stream(i, 1.5, 0.05) for i in range(10)]
    return [measured("colocated", "colocated", colocated, slos), measured("pd", "pd", pd, slos)]


def test_one_rule_default_slos_judge_and_are_stated():
    entries = frozen_colocated_and_slow_pd()
    assert entries[0]["result"]["request_goodput"] is None  # no --goodput given
    rec = recommend(entries)
    assert rec["choice"] == "pd" and rec["split"] is True  # the stutter counts
    assert rec["slos_default"] is True
    assert rec["slos_ms"] == {"ttft": 2000.0, "tpot": 200.0, "itl": 1000.0}
    assert rec["slos"] == ("Judged by goodput per core against the default SLOs: TTFT ≤ 2000 "
                           "ms, TPOT ≤ 200 ms, longest ITL gap ≤ 1000 ms; pass --goodput to "
                           "set yours.")
    # colocated: 5 of 10 within the SLOs over a 12.5 s run; pd: 10 over 11.5 s; 2 cores.
    # The freezes are 5 of 200 gaps: the pooled ITL p95 does not show them.
    assert figures(entries[0])["slo_attainment"] == pytest.approx(0.5)
    # Paired: the 5 frozen colocated streams are the only requests the two disagree on.
    assert rec["verdict"] == "better" and rec["settled"]
    assert rec["reasons"][0] == (
        "Split prefill and decode: pd vs colocated on the same cores (2): pd is better: goodput "
        "req/s per core +100 % (95% CI +40 %..+160 %; 0.417 vs 0.208); per request, within the "
        "SLOs in both 5, only pd 5, only colocated 0, neither 0; per request (pd - colocated, "
        "median, 95% CI): TTFT 1,000 ms (1,000..1,000), longest ITL gap -1,000 ms "
        "(-2,000..0.0); ITL p50 50.0 vs 50.0 ms, ITL p95 50.0 vs 50.0 ms, TTFT p95 1,500 vs 500 ms.")
    md = report.recommendation_markdown(rec)
    assert md.startswith("## Recommendation\n\n**Use pd** (a PD split): goodput req/s per core "
                         "+100 % over colocated (95% CI +40..+160 %).\n\nJudged by goodput "
                         "per core against the default SLOs"), md


def test_with_slos_given_the_same_rule_uses_them():
    rec = recommend(frozen_colocated_and_slow_pd({"ttft": 1000.0}))
    assert rec["choice"] == "colocated" and rec["slos_default"] is False  # pd misses TTFT
    assert rec["slos"] == "Judged by goodput per core against your SLOs (--goodput): TTFT ≤ 1000 ms."
    assert rec["reasons"][0].startswith("Do not split at this load: colocated vs pd")


def test_one_run_says_the_spread_is_unknown_and_ties_within_5_percent():
    entries = [entry("colocated", goodput=0.50, itl95=210), entry("pd", "pd", goodput=0.52)]
    assert cannot_tell_apart(*entries)
    rec = recommend(entries)
    assert rec["choice"] == "colocated" and rec["cannot_tell_apart"] == ["colocated", "pd"]
    assert rec["runs"] == 1 and rec["n"] == 20
    assert rec["evidence"] == ("n = 20 requests, 1 run per configuration, no per-request "
                               "outcomes: the spread is unknown, so goodputs within 5% count as "
                               "a tie and larger differences may still be noise.")
    assert rec["verdict"] == "no interval"
    assert ("cannot tell apart by goodput (within 5%, one run each: colocated 0.25, pd 0.26 "
            "req/s per core); colocated is the simpler (no prefill/decode split, no KV "
            "hand-off);") in rec["reasons"][0]
    md = report.recommendation_markdown(rec)
    assert "**Cannot tell colocated and pd apart by goodput; use colocated** (the simpler" in md


def runs(name, mode, goodputs, cores=2):
    return [entry(name, mode, goodput=g, cores=cores) for g in goodputs]


def test_overlapping_ranges_over_repeats_cannot_be_told_apart():
    colocated = combine(runs("colocated", "colocated", [0.20, 0.28, 0.24]))
    pd = combine(runs("pd", "pd", [0.26, 0.30, 0.22]))  # median 0.26 > 0.24: noise
    rec = recommend([colocated, pd])
    assert rec["choice"] == "colocated" and rec["cannot_tell_apart"] == ["colocated", "pd"]
    assert rec["runs"] == 3
    assert ("cannot tell apart by goodput (ranges overlap: colocated 0.12 (0.1–0.14), pd 0.13 "
            "(0.11–0.15) req/s per core)") in rec["reasons"][0]
    assert rec["evidence"] == ("n = 20 requests per run, 3 runs per configuration, no "
                               "per-request outcomes; goodput per core, median (min–max): "
                               "colocated 0.12 (0.1–0.14); pd 0.13 (0.11–0.15) req/s per core.")


def test_separate_ranges_over_repeats_decide():
    colocated = combine(runs("colocated", "colocated", [0.20, 0.22, 0.24]))
    pd = combine(runs("pd", "pd", [0.26, 0.30, 0.28]))
    rec = recommend([colocated, pd])
    assert rec["choice"] == "pd" and rec["cannot_tell_apart"] == []
    assert "pd serves 0.14 (0.13–0.15) req/s per core within the SLOs, colocated 0.11 " \
           "(0.1–0.12)" in rec["reasons"][0]


def test_replicas_win_and_the_report_says_do_not_split():
    entries = [entry("colocated", itl50=150, itl95=900, stalls=4, goodput=0.3),
               entry("colocated-2", itl50=80, itl95=180, goodput=0.8),
               entry("pd", "pd", itl50=114, itl95=230, handoff=GAP, goodput=0.6)]
    rec = recommend(entries)
    assert rec["choice"] == "colocated-2" and rec["split"] is False and rec["meets_slos"]
    assert rec["not_considered"] == {}
    verdict = rec["reasons"][0]
    assert verdict.startswith("Do not split at this load: colocated-2 vs pd on the same cores (2)")
    assert "colocated-2 serves 0.4 req/s per core within the SLOs, pd 0.3;" in verdict
    assert "ITL p50 80.0 vs 114 ms" in verdict
    assert "Bottleneck of colocated-2: prefill is 70% of TTFT (mean 350 of 500 ms)." in rec["reasons"]
    hand = [r for r in rec["reasons"] if r.startswith("Hand-off of pd")]
    # gap 120 ms = 24% of the mean TTFT of 500 ms (sum of the parts), 120/114 = 1.1x ITL p50
    assert hand == ["Hand-off of pd (token 1 -> 2): mean 120 ms = 24% of its mean TTFT and "
                    "1.1x its ITL p50, 16.0 MB of KV per request (mean); first decode step is "
                    "91% of the gap (mean 109 of 120 ms); the first decode step is the decode "
                    "worker's step that takes in the KV, batched with the running requests."]
    assert any("colocated 900 / 400 ms, 4 stalls" in r for r in rec["reasons"])
    assert ("Goodput per core (share of requests within the SLOs): colocated 0.15 req/s per "
            "core (90%); colocated-2 0.4 req/s per core (90%); pd 0.3 req/s per core (90%); "
            "colocated-2 leads per core.") in rec["reasons"]


def test_tied_splits_go_to_the_latency_rule():
    # Both split: the simpler-kind preference has nothing to choose; TTFT p95 of 2p1d is 3x
    # the best, out of the 25% tolerance.
    entries = [entry("2p1d", "pd", ttft95=3000, itl95=150), entry("pd", "pd", itl95=160)]
    rec = recommend(entries)
    assert rec["choice"] == "pd" and rec["cannot_tell_apart"] == ["2p1d", "pd"]


def test_ttft_within_tolerance_and_itl_tie_go_to_throughput_per_device():
    entries = [entry("colocated-2", ttft95=1000, itl95=200, tput=20),
               entry("colocated", ttft95=1100, itl95=203, tput=30),
               entry("pd", "pd", ttft95=1000, itl95=200, tput=20)]
    rec = recommend(entries)
    assert rec["choice"] == "colocated"  # 15 vs 10 output tok/s per core
    assert rec["cannot_tell_apart"] == ["colocated-2", "colocated", "pd"]
    assert rec["reasons"][0].endswith(
        "colocated is the simpler (no prefill/decode split, no KV hand-off); ITL p50 100 vs "
        "100 ms, ITL p95 203 vs 200 ms, TTFT p95 1,100 vs 1,000 ms.")
    for e in entries:  # overload, no E2EL apart: the latency rule decides, and says how
        e["result"].update(request_goodput=0.0, slo_attainment=0.0)
    rec = recommend(entries[1:])
    assert rec["choice"] == "colocated" and rec["cannot_tell_apart"] == ["colocated", "pd"]
    assert rec["overloaded"] and rec["verdict"] == "overloaded"
    assert ("colocated vs pd on the same cores (2): by E2EL per request, colocated's is not "
            "shown different than pd's: p50 5,000 vs 5,000 ms, no per-request interval;") in rec["reasons"][1]


def test_goodput_per_core_decides_across_core_counts():
    entries = [entry("colocated", goodput=0.4, itl95=100),
               entry("2p1d", "pd", goodput=0.9, itl95=300, cores=2),
               entry("colocated-2", goodput=0.9, itl95=100, cores=4)]  # more cores: 0.225/core
    rec = recommend(entries)
    assert rec["choice"] == "2p1d" and rec["meets_slos"] is True
    assert rec["reasons"][0].startswith(
        "Split prefill and decode: 2p1d vs colocated-2 with 2 cores vs 4 cores: 2p1d serves "
        "0.45 req/s per core within the SLOs, colocated-2 0.225;")


def gpu(name, mode, goodput, gpus, price):
    e = entry(name, mode, goodput=goodput, tput=100.0 * gpus)
    e["resources"] = {"device_kind": "GPU", "num_devices": gpus, "price_per_hour": price}
    return e


def test_per_dollar_decides_when_every_candidate_has_a_price():
    # vllm-8: 0.5 req/s per GPU, 4 * 3600 / 16 = 900 requests per USD;
    # sglang-1p1d: 0.6 req/s per GPU on dearer GPUs, 2.4 * 3600 / 12 = 720 per USD.
    entries = [gpu("vllm-8", "colocated", 4.0, 8, 16.0), gpu("sglang-1p1d", "pd", 2.4, 4, 12.0)]
    f = figures(entries[0])
    assert (f["goodput_per_device"], f["goodput_per_usd"]) == (0.5, pytest.approx(900.0))
    assert f["output_per_usd"] == pytest.approx(800 * 3600 / 16)
    rec = recommend(entries)
    assert rec["choice"] == "vllm-8" and rec["basis"] == "per USD"
    assert "vllm-8 serves 900 requests per USD within the SLOs, sglang-1p1d 720" in rec["reasons"][0]
    assert any(r.endswith("sglang-1p1d leads per GPU.") for r in rec["reasons"])
    assert any(r.endswith("vllm-8 leads per USD.") for r in rec["reasons"])
    assert rec["slos"].startswith("Judged by goodput per USD against your SLOs")
    del entries[1]["resources"]["price_per_hour"]  # one price missing: per GPU decides
    rec = recommend(entries)
    assert rec["choice"] == "sglang-1p1d" and rec["basis"] == "per GPU"


def test_cores_and_gpus_mixed_without_prices_say_so():
    entries = [entry("epdserve", goodput=0.2), gpu("vllm", "colocated", 4.0, 1, None)]
    rec = recommend(entries)
    assert rec["basis"] == "per device"
    assert ("Per device compares CPU cores with GPUs; give each deployment's price_per_hour to "
            "compare per USD.") in rec["reasons"]


def test_overload_is_said_and_ranked_by_e2el_then_by_capacity():
    """Every configuration past its capacity: not a goodput ranking (1 vs 0 requests within
    the SLOs is noise), but what to do and the measure that still separates them."""
    entries = [entry("colocated", goodput=0.02, itl95=100, e2el50=9000),
               entry("pd", "pd", goodput=0.0, itl95=300, e2el50=4000)]
    for e, share in zip(entries, (0.06, 0.0)):
        e["result"]["slo_attainment"] = share
    rec = recommend(entries)
    assert rec["overloaded"] and rec["meets_slos"] is True and rec["choice"] == "pd"
    assert rec["settled"]  # more runs of this load cannot rank them by goodput
    assert rec["headline"] == ("**Overloaded: no configuration serves most requests within the "
                               "SLOs; by E2EL, use pd** (a PD split).")
    assert rec["reasons"][0] == (
        "Overloaded: every configuration misses the SLOs for most requests (colocated 6%, pd 0% "
        "within them), so goodput does not rank them at this load. Ranked by per-request E2EL, "
        "paired (the one that drains the load sooner), since no sweep was run. To decide by "
        "goodput: send fewer requests per second (--request-rate), measure each configuration's "
        "capacity (--goodput ... --sweep-rates LO:HI), or add workers.")
    assert "by E2EL per request, pd's is shown lower than colocated's: p50 4,000 vs 9,000 ms" in rec["reasons"][1]
    for e, rate in zip(entries, (0.5, 0.3)):  # a sweep measured each one's capacity
        e["sweep"] = {"max_rate": rate}
    rec = recommend(entries)
    assert rec["choice"] == "colocated" and "by capacity" in rec["headline"]
    assert ("by capacity (the highest rate within the SLOs, per device): colocated 0.25, pd "
            "0.15 req/s") in rec["reasons"][1]


def test_failed_configurations_and_runs_are_not_considered():
    flaky = combine([entry("colocated-3", itl95=10),
                     {"name": "colocated-3", "mode": "colocated", "error": "died"}])
    entries = [{"name": "pd", "mode": "pd", "error": "pd server exited with status 1"},
               entry("colocated-2", failed=3, itl95=50),
               entry("colocated", itl95=300),
               entry("colocated-chunked", completed=0),
               flaky]
    rec = recommend(entries)
    assert rec["choice"] == "colocated"  # the only one that served every request
    assert rec["not_considered"] == {"pd": "pd server exited with status 1",
                                     "colocated-2": "3 failed requests",
                                     "colocated-chunked": "no request completed",
                                     "colocated-3": "1 failed runs (died)"}
    assert rec["reasons"][0] == "Use colocated (the only kind measured: colocated)."
    assert "Not considered: pd (pd server exited with status 1)." in rec["reasons"]


def test_nothing_ran():
    rec = recommend([{"name": "pd", "mode": "pd", "error": "boom"}])
    assert rec["choice"] is None and rec["split"] is None
    assert report.recommendation_markdown(rec).startswith("## Recommendation\n\n**No recommendation.**")


@pytest.mark.parametrize("missing", ["breakdown", "resources", "itl_stalls"])
def test_missing_optional_fields_do_not_break_it(missing):
    entries = [entry("colocated"), entry("pd", "pd", handoff=GAP)]
    for e in entries:
        del e[missing]
    assert recommend(entries)["choice"] in ("colocated", "pd")


def test_an_elastic_winner_says_how_often_it_switched():
    """An elastic deployment is no PD split when it kept its roles: the head says what it did."""
    still = entry("elastic", mode="elastic")
    still["role_switches"] = {"count": 0, "requested": 0, "decisions": []}
    rec = recommend([still])
    assert rec["reasons"][0] == "Use elastic (the only kind measured: elastic)."
    assert "**Use elastic** (elastic: 0 role switches during the run)." in report.recommendation_markdown(rec)
    still["role_switches"]["count"] = 1
    assert "(elastic: 1 role switch during the run)." in report.recommendation_markdown(recommend([still]))


def test_a_disturbed_measurement_qualifies_the_recommendation():
    rec = recommend([entry("colocated"), entry("pd", mode="pd", goodput=0.2)])
    warning = "pd: other processes used 27% of cores 0-1 during the run"
    md = report.recommendation_markdown(rec, [warning])
    assert md.startswith("## Recommendation\n\n**Use colocated** (no prefill/decode split). **But other processes "
                         f"loaded the cores during 1 run(s)** ({warning}): measure again on a quiet machine"), md
    assert "quiet machine" not in report.recommendation_markdown(rec)


def engine_entry(e: dict, engine: str | None) -> dict:
    """``e`` as a deployments-file entry that starts processes (another engine)."""
    return {**e, "deployment": {"name": e["name"], "source": "f.toml", **({"engine": engine} if engine else {})}}


def test_engines_are_judged_as_engines_and_named_as_what_they_are():
    """epdserve's colocated against vLLM's, colocated too: never "the only kind measured", and
    the words name each deployment's engine, kind and cores."""
    colocated, pd = frozen_colocated_and_slow_pd()
    vllm = engine_entry({**pd, "name": "vllm-cpu", "mode": "colocated"}, "vLLM")
    rec = recommend([colocated, vllm])
    assert rec["choice"] == "vllm-cpu" and rec["verdict"] == "better"
    assert rec["headline"].startswith("**Use vllm-cpu** (vLLM, colocated, 2 cores): goodput req/s per core +")
    assert rec["reasons"][0].startswith("Engines: vllm-cpu (vLLM, colocated, 2 cores) vs colocated "
                                        "(epdserve, colocated, 2 cores): ")
    # A tie between engines is said as a tie, decided by latency (rule 3), not by "the simpler".
    same = engine_entry({**colocated, "name": "other", "memory_peak_bytes": 3 * 2**30}, None)  # its own name
    rec = recommend([same, {**colocated, "memory_peak_bytes": 2**29}])
    assert rec["verdict"] == "tie" and "(the simpler" not in rec["headline"]
    # ... and says what differs besides goodput, memory included.
    assert "What differs: ITL p50 " in rec["headline"] and rec["headline"].endswith(" GiB.")
    assert "peak memory 0.50 vs 3.00 GiB" in rec["headline"] or "peak memory 3.00 vs 0.50 GiB" in rec["headline"]
    assert "(other, colocated, 2 cores)" in rec["headline"] or "(epdserve, colocated, 2 cores)" in rec["headline"]
    assert rec["reasons"][0].startswith("Engines: ")
