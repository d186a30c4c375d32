"""The comparison table (epdserve/bench/report.py) as a newcomer reads it, and repeated runs
folded into one entry (epdserve/bench/repeats.py), on hand-made compare entries."""

import pytest

from epdserve.bench import plots, report
from epdserve.bench.client import RequestRecord
from epdserve.bench.metrics import compute
from epdserve.bench.repeats import PLOT_ARRAYS, combine


def records(ttft: float, gap: float, n: int = 4) -> list[RequestRecord]:
    """n requests sent 1 s apart, 11 chunks from ``ttft``, ``gap`` apart (s)."""
    out = []
    for i in range(n):
        times = [ttft + gap * k for k in range(11)]
        out.append(RequestRecord(index=i, start_s=float(i), chunk_times_s=times,
                                 last_chunk_s=times[-1], end_s=i + times[-1],
                                 usage_completion_tokens=11, request_id=f"r{i}", success=True,
                                 generated_text="x" * 11))
    return out


def run(name, mode, ttft, gap, *, stalls=0, outside=None, kv=0.0, cores=2):
    """One compare entry as run_config returns it (no SLOs given); ``outside``: the share
    of the cores other processes took (a host_load with only that)."""
    e = {"name": name, "mode": mode, "result": compute(records(ttft, gap)),
         "resources": {"num_cores": cores, "workers": []}, "itl_stalls": stalls,
         "server": {"mean_kv_bytes": kv, "num_records": 4, "matched_client_requests": 4},
         "breakdown": {"ttft": None, "handoff": None}}
    if outside is not None:
        e["host_load"] = {"during": {"outside_share": outside}, "warning": None}
    return e


def by_label(entries):
    header, rows = report.table(entries)
    return header, {r[0]: r[1:] for r in rows}


def test_rows_say_their_better_direction_and_unit_and_ratios_say_of_what():
    entries = [{**run("colocated", "colocated", 0.5, 0.05), "memory_peak_bytes": 2**30},
               {**run("pd", "pd", 0.75, 0.04, kv=16_220_352), "memory_peak_bytes": 3 * 2**29}]
    header, rows = by_label(entries)
    assert rows["Peak memory (GiB, resident)"] == ["lower", "1.00", "1.50", "1.50x"]
    assert header == ["Metric", "Better", "colocated", "pd", "pd (x of colocated)"]
    assert rows["TTFT p50 (ms)"] == ["lower", "500.0", "750.0", "1.50x"]
    assert rows["ITL p50 (ms)"] == ["lower", "50.0", "40.0", "0.80x"]
    assert rows["Output tok/s"][0] == "higher"
    assert rows["KV per request (MB, mean)"] == ["lower", "0.00", "16.22", "—"]
    assert rows["Cores"] == ["—", "2", "2", "1.00x"]
    assert rows["Output tok/s per core"][0] == "higher"
    # goodput against the default SLOs, computed from the per-request arrays
    assert rows["Goodput (req/s within the SLOs)"][0] == "higher"
    assert rows["SLO attainment (% of requests)"] == ["higher", "100%", "100%", "1.00x"]
    assert "Price (USD/h)" not in rows and "GPUs" not in rows  # none given
    text = report.text_table(entries)
    assert text.index("p50 = median") < text.index("TTFT p50 (ms)")  # the caption leads
    assert "(the default SLOs: TTFT ≤ 2000 ms, TPOT ≤ 200 ms, longest ITL gap ≤ 1000 ms)" in \
        " ".join(text.split())
    assert "One run per configuration: the verdict's interval is over its requests only" in \
        " ".join(text.split())
    assert '"x of colocated" = the value ÷ colocated\'s' in report.caption(entries)


def test_repeats_show_median_and_range():
    colocated = combine([run("colocated", "colocated", t, 0.05, stalls=s)
                         for t, s in ((0.5, 0), (0.6, 2), (0.4, 1))])
    pd = combine([run("pd", "pd", t, 0.04) for t in (0.7, 0.8, 0.75)])
    _, rows = by_label([colocated, pd])
    assert rows["TTFT p50 (ms)"] == ["lower", "500.0 (400.0–600.0)", "750.0 (700.0–800.0)", "1.50x"]
    assert rows["ITL stalls (gaps > 1 s)"] == ["lower", "1 (0–2)", "0 (0–0)", "0.00x"]
    assert "Each cell is the median of 3 runs (min–max)." in report.caption([colocated, pd])
    md = report.markdown_report([colocated, pd], {"source": "test"},
                                {"num_requests": 4, "duration_of_arrivals_s": 3.0})
    assert "- median of 3 runs: completed 4, failed 0, duration" in md
    assert "- per run (completed / failed, duration, goodput): 4 / 0, 4.0 s, 1.000 req/s;" in md


def test_gpu_deployments_are_per_gpu_and_prices_give_per_usd_rows():
    a, b = run("vllm", "colocated", 0.5, 0.05), run("vllm-1p1d", "pd", 0.4, 0.04)
    a["resources"] = {"device_kind": "GPU", "num_devices": 1, "price_per_hour": 4.0}
    b["resources"] = {"device_kind": "GPU", "num_devices": 2, "price_per_hour": 8.0}
    _, rows = by_label([a, b])
    assert rows["GPUs"] == ["—", "1", "2", "2.00x"] and "Cores" not in rows
    assert rows["Output tok/s per GPU"][0] == "higher"
    assert rows["Price (USD/h)"] == ["lower", "4.00", "8.00", "2.00x"]
    # 4 requests in 4 s (the last sent at 3 s, done at 3 + 0.5 + 10 * 0.05) at 4 USD/h:
    # 1 req/s * 3600 / 4 = 900 requests per USD
    assert rows["Goodput requests per USD"][:2] == ["higher", "900.0"]
    assert rows["Output tokens per USD"][0] == "higher"
    c = run("epdserve", "colocated", 0.5, 0.05)  # cores, no price: mixed kinds
    _, rows = by_label([c, a])
    assert rows["Cores"][:3] == ["—", "2", "—"] and rows["GPUs"][:3] == ["—", "—", "1"]
    assert "Output tok/s per device" in rows
    assert rows["Price (USD/h)"][:3] == ["lower", "—", "4.00"]


def test_breakdown_and_recommendation_are_labelled():
    e = run("pd", "pd", 0.5, 0.05)
    e["breakdown"]["ttft"] = {"n": 4, "parts": ["prefill", "other"],
                              "mean": {"prefill": 450.0, "other": 50.0},
                              "p95": {"prefill": 600.0, "other": 80.0}}
    md = report.markdown_report([e], {"source": "test"},
                                {"num_requests": 4, "duration_of_arrivals_s": 3.0})
    assert "## Where TTFT goes (mean and p95 of each part, ms)" in md
    assert "| Part (ms) | pd mean | pd p95 |" in md
    assert "| **sum of the means (client)** | **500.0** | n=4 |" in md
    assert md.index("Latencies are client-side percentiles") < md.index("| Metric | Better |")


def test_combine_takes_medians_ranges_and_the_first_runs_arrays(tmp_path):
    runs = [{**run("pd", "pd", t, 0.05, outside=o, kv=kv), "memory_peak_bytes": m}
            for t, o, kv, m in ((0.5, 0.0, 100.0, 5), (0.9, 0.3, 300.0, 7), (0.6, 0.1, 200.0, 6))]
    e = combine(runs)
    assert e["memory_peak_bytes"] == 7  # the highest run's
    r = e["result"]
    assert r["median_ttft_ms"] == pytest.approx(600.0)
    assert e["spread"]["median_ttft_ms"] == [pytest.approx(500.0), pytest.approx(900.0)]
    assert r["completed"] == 4 and isinstance(r["completed"], int)
    assert e["server"]["mean_kv_bytes"] == 200.0
    assert e["host_load"]["during"]["outside_share"] == 0.3  # the most disturbed run
    assert [x["median_ttft_ms"] for x in e["runs"]] == pytest.approx([500.0, 900.0, 600.0])
    # goodput judged against the default SLOs in every run, before the arrays go
    assert r["goodput_slos_default"] is True and r["goodput_slos_ms"]["itl"] == 1000.0
    assert r["request_goodput"] > 0 and e["spread"]["request_goodput"][0] > 0
    assert set(PLOT_ARRAYS) <= set(r) and "generated_texts" not in r
    assert r["ttfts"] == runs[0]["result"]["ttfts"]
    assert r["error_counts"] == {} and r["kinds"] == ["chat"] * 4
    assert runs[1]["result"]["request_goodput"] is None  # the runs are left as they were
    pngs = plots.plot_all([e], [], tmp_path)  # the first run's arrays are enough to draw
    assert all(p.stat().st_size > 10_000 for p in pngs)


def test_combine_one_run_and_failed_runs():
    one = run("colocated", "colocated", 0.5, 0.05)
    e = combine([one])
    assert e["spread"] is None and len(e["runs"]) == 1
    assert e["result"] is one["result"]  # one run: the entry as it is
    failed = {"name": "colocated", "mode": "colocated", "error": "server exited with status 1"}
    e = combine([failed, one])
    assert e["spread"] is None and e["failed_runs"] == ["server exited with status 1"]
    assert combine([failed, failed])["error"] == "server exited with status 1 (all 2 runs failed)"
    with pytest.raises(ValueError, match="no runs"):
        combine([])
    with pytest.raises(ValueError, match=r"\['colocated', 'pd'\]"):
        combine([one, run("pd", "pd", 0.5, 0.05)])
