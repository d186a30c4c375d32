"""/metrics under vLLM's names: every ``vllm:`` metric vLLM's own Grafana dashboard queries
(``tests/data/vllm_grafana_metrics.txt``, taken from the dashboard's JSON) is served by a
colocated and a PD deployment with the served model's ``model_name`` label, and the
``vllm:`` view sums the workers into one series per deployment, as a gateway scraper reads
it. Pure tests check ``RouterMetrics``' prefixes, aggregation and request-level histograms."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.bench import server_metrics as sm
from epdserve.serving.metrics import RouterMetrics, build_1_2_5_buckets
from epdserve.trace import RequestTrace

DASHBOARD = Path(__file__).parent / "data" / "vllm_grafana_metrics.txt"


def dashboard_metrics() -> list[tuple[str, str, list[str]]]:
    """``(family, type, extra labels)`` of every metric the dashboard queries."""
    rows = [line.split() for line in DASHBOARD.read_text().splitlines() if line and not line.startswith("#")]
    return [(name, kind, labels) for name, kind, *labels in rows]


def families(text: str) -> dict[str, tuple[str, list[dict]]]:
    """``family name -> (type, label sets of its samples)`` of a text exposition."""
    return {f.name: (f.type, [s.labels for s in f.samples]) for f in text_string_to_metric_families(text)}


def value(text: str, sample: str, **labels) -> float:
    """The value of the one sample named ``sample`` whose labels include ``labels``."""
    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) == 1, (sample, labels, found)
    return found[0]


def record(request_id: str, output_tokens: int, **stages) -> RequestTrace:
    return RequestTrace(request_id=request_id, mode="pd", path="disaggregated", prompt_tokens=12,
                        output_tokens=output_tokens, max_tokens=16, finish_reason="length", ttft_ms=40.0,
                        e2e_ms=90.0, router_queue_ms=1.0, prefill_queue_ms=2.0, decode_queue_ms=3.0,
                        prefill_ms=20.0, decode_ms=45.0, **stages)


# ------------------------------------------------------------------ pure


def test_the_dashboard_list_names_vllms_metrics():
    names = [name for name, _, _ in dashboard_metrics()]
    assert len(names) == len(set(names)) >= 15 and all(n.startswith("vllm:") for n in names)


def test_a_fresh_router_already_serves_every_dashboard_metric():
    """Before any request and any worker, as vLLM: a dashboard shows zeros, not 'no data'."""
    text = RouterMetrics("m").render().decode()
    got = families(text)
    for name, kind, labels in dashboard_metrics():
        assert got[name][0] == kind, name
        assert got[name][1] and all(s["model_name"] == "m" and set(labels) <= set(s) for s in got[name][1]), name


def test_the_prefix_picks_the_views_and_epdserves_own_metrics_stay():
    vllm = families(RouterMetrics("m", "vllm").render().decode())
    epd = families(RouterMetrics("m", "epdserve").render().decode())
    assert "vllm:time_to_first_token_seconds" in vllm and "epdserve:time_to_first_token_seconds" not in vllm
    assert "epdserve:time_to_first_token_seconds" in epd and not any(n.startswith("vllm:") for n in epd)
    for own in ("epdserve:kv_transfer_seconds", "epdserve:request_failure", "epdserve:bad_request"):
        assert own in vllm and own in epd
    with pytest.raises(ValueError, match="metrics prefix 'sglang'"):
        RouterMetrics("m", "sglang")


def test_the_vllm_view_is_one_series_for_the_deployment():
    """Gateway scrapers take one series per endpoint: the live workers' sums; usage over
    the blocks of the workers that hold KV; a worker marked down leaves the sums."""
    m = RouterMetrics("m")
    m.set_worker_up("p0", "prefill", True)
    m.set_worker("p0", "prefill", blocks_in_use=30, blocks_total=100, num_running=2, num_waiting=3,
                 prefix_cache_queries=50, prefix_cache_hits=20)
    m.set_worker("d0", "decode", blocks_in_use=10, blocks_total=100, num_running=4, num_waiting=1,
                 prefix_cache_queries=10, prefix_cache_hits=5)
    m.set_worker("e0", "encode", blocks_in_use=0, blocks_total=0, num_running=1, num_waiting=0)
    text = m.render().decode()
    assert value(text, "vllm:num_requests_running") == 7 and value(text, "vllm:num_requests_waiting") == 4
    assert value(text, "vllm:kv_cache_usage_perc") == pytest.approx(0.2)
    assert value(text, "vllm:gpu_cache_usage_perc") == pytest.approx(0.2)  # vLLM's name before 0.10
    assert value(text, "vllm:prefix_cache_hits_total") == 25
    assert value(text, "epdserve:kv_cache_usage_perc", worker="p0", role="prefill") == pytest.approx(0.3)
    assert value(text, "vllm:lora_requests_info", running_lora_adapters="", max_lora="0") > 0
    m.set_worker_up("p0", "prefill", False)
    text = m.render().decode()
    assert value(text, "vllm:num_requests_running") == 5 and value(text, "vllm:kv_cache_usage_perc") == 0.1
    assert value(text, "epdserve:worker_up", worker="p0", role="prefill") == 0


def test_request_histograms_follow_vllms_meanings():
    """Per engine request: token counts, max_tokens, TPOT; per parent request of n choices:
    n and the most tokens a choice generated; queue time: the worker queues (the router's
    own wait only under epdserve:, stage router); inference = prefill + decode."""
    m = RouterMetrics("m", "both", max_model_len=100)
    m.admitted("cmpl-1", 2)
    m.ended(record("cmpl-1-0", 3), [0.02, 0.04])
    m.ended(record("cmpl-1-1", 5), [0.01] * 4)
    m.ended(record("cmpl-2", 1), None)  # failed: counted, and observed as a parent of one
    text = m.render().decode()
    assert value(text, "vllm:request_params_n_count") == 2 and value(text, "vllm:request_params_n_sum") == 3
    assert value(text, "vllm:request_max_num_generation_tokens_sum") == 5 + 1
    assert value(text, "vllm:request_generation_tokens_sum") == 8
    assert value(text, "vllm:request_params_max_tokens_sum") == 32
    assert value(text, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.03 + 0.01)
    assert value(text, "vllm:inter_token_latency_seconds_count") == 6
    assert value(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(2 * 0.005)
    assert value(text, "epdserve:request_queue_time_seconds_sum", stage="router") == pytest.approx(0.002)
    assert value(text, "vllm:request_inference_time_seconds_sum") == pytest.approx(2 * 0.065)
    assert value(text, "vllm:request_success_total", finished_reason="length") == 2
    assert value(text, "epdserve:request_failure_total") == 1
    assert value(text, "vllm:request_success_total", finished_reason="error") == 1
    buckets = {s.labels["le"] for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_prompt_tokens_bucket"}
    assert buckets == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"}


def test_token_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)  # vLLM's docstring example
    assert build_1_2_5_buckets(8192)[-1] == 5000 and build_1_2_5_buckets(0) == (1,)


def test_each_reported_step_is_one_iteration_observation():
    m = RouterMetrics("m")
    base = dict(blocks_in_use=1, blocks_total=10, num_running=1, num_waiting=0)
    for steps, tokens in ((1, 40), (1, 40), (2, 1), (3, 2), (1, 9)):  # a repeat, then a restart
        m.set_worker("w0", "colocated", num_steps=steps, last_step_tokens=tokens, **base)
    text = m.render().decode()
    assert value(text, "vllm:iteration_tokens_total_count") == 4
    assert value(text, "vllm:iteration_tokens_total_sum") == 40 + 1 + 2 + 9


def test_bench_reads_a_router_with_both_prefixes_as_epdserve():
    m = RouterMetrics("m", "both")
    scrape = sm.Scrape.parse("u", m.render().decode())
    assert sm.detect_engine([scrape]) == "epdserve"
    assert sm.detect_engine([sm.Scrape.parse("u", RouterMetrics("m", "vllm").render().decode())]) == "vllm"


# ------------------------------------------------------------------ served


def test_a_deployment_serves_vllms_dashboard_metrics(server):
    """Colocated and PD: after a request, every dashboard metric has a series labelled with
    the served model name, and the ``vllm:`` and ``epdserve:`` views counted it alike."""
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    server.generate("completion", "The capital of France is", stream=False, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    got = families(text)
    for name, kind, labels in dashboard_metrics():
        assert name in got, name
        assert got[name][0] == kind, name
        assert any(s.get("model_name") == model and set(labels) <= set(s) for s in got[name][1]), name
    assert all(s["model_name"] == model for f in got.values() for s in f[1])
    for name in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count", "request_generation_tokens_sum"):
        assert value(text, f"vllm:{name}") == value(text, f"epdserve:{name}") > 0, name
    assert value(text, "vllm:iteration_tokens_total_count") > 0
    assert value(text, "vllm:request_success_total", finished_reason="length") >= 1
    # n = 2: two engine requests, one parent request observed once with n = 2.
    before = (value(text, "vllm:request_params_n_count"), value(text, "vllm:request_params_n_sum"),
              value(text, "vllm:request_prompt_tokens_count"))
    server.generate("completion", "One, two,", stream=False, max_tokens=3, temperature=0.5, n=2, seed=1)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    after = (value(text, "vllm:request_params_n_count"), value(text, "vllm:request_params_n_sum"),
             value(text, "vllm:request_prompt_tokens_count"))
    assert [b - a for a, b in zip(before, after)] == [1, 2, 2]


def test_the_router_option_sets_the_prefix_and_the_served_name(model_info, capsys):
    """``--metrics-prefix`` (``epdserve router`` and ``serve``) reaches the router's metrics,
    labelled with the served model's name; another value is a CLI error naming it."""
    import argparse

    from epdserve.argtypes import config_from
    from epdserve.serving.router.app import RouterCommand, add_arguments, build_router

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = config_from(RouterCommand, parser.parse_args(["--metrics-prefix", "vllm"])).router
    router = build_router(options, "ipc:///nonexistent/events")
    try:
        text = router.metrics.render().decode()
    finally:
        router.front.close()
        router.port.close()
    assert value(text, "vllm:num_requests_running", model_name=model_info.name) == 0
    assert "epdserve:time_to_first_token_seconds" not in text and "epdserve:kv_transfer_seconds" in text
    assert parser.parse_args([]).metrics_prefix == "both"
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics-prefix", "prometheus"])
    assert "invalid choice: 'prometheus'" in capsys.readouterr().err
