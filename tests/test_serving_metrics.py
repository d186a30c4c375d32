"""/metrics agrees with the trace file: after a few requests, each per-stage histogram
(queue by stage, prefill and decode by role, TTFT, E2E, ITL, TPOT, KV transfer) has one
observation per traced request that went through that stage, summing to the trace's times."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
ROUTER = {"engine": "router"}  # the labels of the series the router computes (not a worker's)


def histograms(url: str) -> dict[tuple[str, tuple], tuple[float, float]]:
    """``(name, sorted labels) -> (count, sum)`` of every histogram on /metrics."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name.endswith(("_count", "_sum")):
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}  # on every series
                key = (family.name, tuple(sorted(labels.items())))
                count, total = out.get(key, (0.0, 0.0))
                if sample.name.endswith("_count"):
                    count = sample.value
                else:
                    total = sample.value
                out[key] = (count, total)
    return out


def abandon_before_the_first_token(server) -> None:
    """A client that gives up before its long prompt's first token: the request is
    recorded without an error and with no output token (other tests' clients that leave
    early, on a slow machine, leave such records too)."""
    def lines() -> int:
        return len(server.trace_path.read_text().splitlines()) if server.trace_path.exists() else 0

    before = lines()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "word " * 1500, "max_tokens": 4}, timeout=0.05)
    deadline = time.monotonic() + 60
    while lines() == before:
        assert time.monotonic() < deadline, "the abandoned request was never recorded"
        time.sleep(0.1)


def test_stage_histograms_match_the_trace(pd_server):
    abandon_before_the_first_token(pd_server)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: pd_server.generate("completion", p, stream=True, max_tokens=12,
                                                             temperature=0), PROMPTS))
    for r in results:
        pd_server.trace(r.id)  # written once the request has been recorded
    # Every request this deployment finished, also other tests'.
    recs = [json.loads(line) for line in pd_server.trace_path.read_text().splitlines()]
    recs = [r for r in recs if r["error"] is None]
    hist = histograms(pd_server.url)

    def check(name: str, labels: dict, key: str, scale: float = 1000.0) -> None:
        values = [r[key] for r in recs if r.get(key) is not None]
        count, total = hist[(name, tuple(sorted({**ROUTER, **labels}.items())))]
        assert count == len(values), name
        assert total == pytest.approx(sum(values) / scale, rel=1e-6, abs=1e-9), name

    check("epdserve:request_queue_time_seconds", {"stage": "router"}, "router_queue_ms")
    check("epdserve:request_queue_time_seconds", {"stage": "prefill"}, "prefill_queue_ms")
    check("epdserve:request_queue_time_seconds", {"stage": "decode"}, "decode_queue_ms")
    check("epdserve:request_prefill_time_seconds", {"role": "prefill"}, "prefill_ms")
    check("epdserve:request_decode_time_seconds", {"role": "decode"}, "decode_ms")
    check("epdserve:time_to_first_token_seconds", {}, "ttft_ms")
    check("epdserve:e2e_request_latency_seconds", {}, "e2e_ms")
    check("epdserve:kv_transfer_seconds", {}, "kv_transfer_ms")
    handoffs = [r["kv_bytes"] for r in recs if "kv_transfer_ms" in r]
    assert hist[("epdserve:kv_transfer_bytes", tuple(ROUTER.items()))] == (len(handoffs), sum(handoffs))

    # One inter-token gap per token after the first; TPOT once per request with two or more.
    itl_count, itl_sum = hist[("epdserve:inter_token_latency_seconds", tuple(ROUTER.items()))]
    assert itl_count == sum(max(r["output_tokens"] - 1, 0) for r in recs)
    tpot_count = hist[("epdserve:request_time_per_output_token_seconds", tuple(ROUTER.items()))][0]
    assert tpot_count == sum(r["output_tokens"] > 1 for r in recs)
    # The gaps span first to last token: within TTFT and E2E.
    assert 0 < itl_sum <= sum(r["e2e_ms"] - r["ttft_ms"] for r in recs if r["ttft_ms"] is not None) / 1000


def samples(metrics) -> dict[str, float]:
    """``sample name -> value`` of a single-worker RouterMetrics exposition."""
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode())
            for s in f.samples}


def test_worker_totals_become_counters_and_usage_a_fraction():
    """Workers report running totals (preemptions, prefix-cache tokens); the router turns
    them into vLLM-style counters (``..._total``) that keep counting across a worker restart,
    and KV usage into a 0-1 fraction like vLLM's ``kv_cache_usage_perc``."""
    from epdserve.serving.metrics import RouterMetrics

    metrics = RouterMetrics()
    report = dict(num_running=1, num_waiting=0)
    metrics.set_worker("w0", "colocated", blocks_in_use=30, blocks_total=120, num_preemptions=2,
                       prefix_cache_queries=100, prefix_cache_hits=64, **report)
    metrics.set_worker("w0", "colocated", blocks_in_use=60, blocks_total=120, num_preemptions=5,
                       prefix_cache_queries=150, prefix_cache_hits=64, **report)
    # restarted: its totals begin again from zero
    metrics.set_worker("w0", "colocated", blocks_in_use=0, blocks_total=120, num_preemptions=1,
                       prefix_cache_queries=10, prefix_cache_hits=0, **report)
    values = samples(metrics)
    assert values["epdserve:num_preemptions_total"] == 6
    assert values["epdserve:prefix_cache_queries_total"] == 160
    assert values["epdserve:prefix_cache_hits_total"] == 64
    assert values["epdserve:kv_cache_usage_perc"] == 0.0
    metrics.set_worker("w0", "colocated", blocks_in_use=30, blocks_total=120, num_preemptions=1,
                       prefix_cache_queries=10, prefix_cache_hits=0, **report)
    values = samples(metrics)
    assert values["epdserve:kv_cache_usage_perc"] == 0.25
