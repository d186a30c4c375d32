"""The recommendation rules (epdserve/bench/recommend.py) on hand-made compare entries."""

import pytest

from epdserve.bench import report
from epdserve.bench.recommend import recommend


def entry(name, mode="colocated", *, ttft95=1000.0, itl50=100.0, itl95=200.0, itl99=400.0,
          tput=20.0, goodput=None, cores=2, failed=0, completed=20, stalls=0, handoff=None):
    """A compare entry with the fields the rules read (ms, tok/s, req/s)."""
    e = {"name": name, "mode": mode,
         "result": {"p95_ttft_ms": ttft95, "mean_ttft_ms": ttft95 / 2, "median_itl_ms": itl50,
                    "p95_itl_ms": itl95, "p99_itl_ms": itl99, "output_throughput": tput,
                    "request_goodput": goodput, "completed": completed, "failed": failed},
         "resources": {"num_cores": cores},
         "per_core": {"output_throughput": tput / cores,
                      "request_goodput": None if goodput is None else goodput / cores},
         "itl_stalls": stalls,
         "breakdown": {"ttft": {"n": 20, "parts": ["router", "prefill", "other"],
                                "mean": {"router": 5.0, "prefill": 350.0, "other": 145.0},
                                "p95": {"router": 9.0, "prefill": 900.0, "other": 300.0}},
                       "handoff": handoff}}
    if mode == "pd":
        e["server"] = {"mean_kv_bytes": 16e6}
    return e


GAP = {"n": 20, "parts": ["KV import", "other"], "mean": {"KV import": 10.0, "other": 110.0},
       "p95": {"KV import": 20.0, "other": 200.0}}


def test_replicas_win_and_the_report_says_do_not_split():
    entries = [entry("colocated", itl50=150, itl95=900, stalls=4),
               entry("colocated-2", itl50=80, itl95=180),
               entry("pd", "pd", itl50=114, itl95=230, handoff=GAP)]
    rec = recommend(entries)
    assert rec["choice"] == "colocated-2" and rec["split"] is False
    assert rec["meets_slos"] is None and rec["not_considered"] == {}
    verdict = rec["reasons"][0]
    assert verdict.startswith("Do not split at this load: colocated-2 vs pd at the same cores (2)")
    assert "ITL p50 80.0 vs 114 ms" in verdict and "lower ITL p95 (22% lower)" in verdict  # 1 - 180/230
    assert "Bottleneck of colocated-2: prefill is 70% of TTFT (mean 350 of 500 ms)." in rec["reasons"]
    hand = [r for r in rec["reasons"] if r.startswith("Hand-off of pd")]
    # gap 120 ms = 24% of the mean TTFT of 500 ms (sum of the parts), 120/114 = 1.1x ITL p50
    assert hand == ["Hand-off of pd (token 1 -> 2): mean 120 ms = 24% of its mean TTFT and "
                    "1.1x its ITL p50, 16.0 MB of KV per request; other is 92% of the gap "
                    "(mean 110 of 120 ms); other is the decode worker's first step, batched with "
                    "the running requests, plus IPC hops."]
    assert any("colocated 900 / 400 ms, 4 stalls" in r for r in rec["reasons"])
    md = report.recommendation_markdown(rec)
    assert md.startswith("## Recommendation\n\n**Use colocated-2** (no prefill/decode split).")


def test_split_wins_when_colocated_ttft_is_far_worse():
    # colocated has the lower ITL p95, but its TTFT p95 is 3x the best: out of tolerance.
    entries = [entry("colocated", ttft95=3000, itl95=150),
               entry("pd", "pd", ttft95=1000, itl95=160, handoff=GAP)]
    rec = recommend(entries)
    assert rec["choice"] == "pd" and rec["split"] is True
    assert rec["reasons"][0].startswith("Split prefill and decode: pd vs colocated at the same "
                                        "cores (2): colocated's TTFT p95 is 200% higher")


def test_ttft_within_tolerance_and_itl_tie_go_to_throughput_per_core():
    entries = [entry("colocated", ttft95=1100, itl95=203, tput=30),
               entry("pd", "pd", ttft95=1000, itl95=200, tput=20)]
    rec = recommend(entries)
    assert rec["choice"] == "colocated"
    assert "colocated makes more output tok/s per core (15.00 vs 10.00)" in rec["reasons"][0]


def test_with_slos_goodput_per_core_decides():
    entries = [entry("colocated", goodput=0.4, itl95=100),
               entry("2p1d", "pd", goodput=0.9, itl95=300, cores=2),
               entry("colocated-2", goodput=0.9, itl95=100, cores=4)]  # more cores: 0.225/core
    rec = recommend(entries)
    assert rec["choice"] == "2p1d" and rec["meets_slos"] is True
    assert rec["reasons"][0].startswith(
        "Split prefill and decode: 2p1d vs colocated-2 with 2 vs 4 cores: 2p1d serves 0.450 "
        "req/s per core within the SLOs, colocated-2 0.225;")
    assert any(r.startswith("Goodput per core: colocated 0.200 req/s; 2p1d 0.450") for r in rec["reasons"])


def test_nothing_meets_the_slos_falls_back_to_latency_and_says_so():
    entries = [entry("colocated", goodput=0.0, itl95=100), entry("pd", "pd", goodput=0.0, itl95=300)]
    rec = recommend(entries)
    assert rec["meets_slos"] is False and rec["choice"] == "colocated"
    assert rec["reasons"][0].startswith("No configuration meets the SLOs at this load")


def test_failed_configurations_are_not_considered():
    entries = [{"name": "pd", "mode": "pd", "error": "pd server exited with status 1"},
               entry("colocated-2", failed=3, itl95=50),
               entry("colocated", itl95=300),
               entry("colocated-chunked", completed=0)]
    rec = recommend(entries)
    assert rec["choice"] == "colocated"  # the only one that served every request
    assert rec["not_considered"] == {"pd": "pd server exited with status 1",
                                     "colocated-2": "3 failed requests",
                                     "colocated-chunked": "no request completed"}
    assert rec["reasons"][0] == "Use colocated (the only kind measured: colocated)."
    assert "Not considered: pd (pd server exited with status 1)." in rec["reasons"]


def test_nothing_ran():
    rec = recommend([{"name": "pd", "mode": "pd", "error": "boom"}])
    assert rec["choice"] is None and rec["split"] is None
    assert report.recommendation_markdown(rec).startswith("## Recommendation\n\n**No recommendation.**")


@pytest.mark.parametrize("missing", ["breakdown", "resources", "per_core", "itl_stalls"])
def test_missing_optional_fields_do_not_break_it(missing):
    entries = [entry("colocated"), entry("pd", "pd", handoff=GAP)]
    for e in entries:
        del e[missing]
    assert recommend(entries)["choice"] in ("colocated", "pd")
