"""Server-side stages from Prometheus /metrics (epdserve.bench.server_metrics).

Pure tests read expositions as each engine prints them: vLLM, SGLang and epdserve print
theirs with prometheus_client, so they are rendered here by prometheus_client from the
metric names, label names and buckets of vLLM's vllm/v1/metrics/loggers.py, SGLang's
python/sglang/srt/metrics/collector.py and epdserve's own RouterMetrics; llama.cpp writes
its text by hand (tools/server/server-task.cpp ``to_metrics``, the llama.cpp vendored by
llama-cpp-python 0.3.36), copied here line for line. The real test scrapes a running
``epdserve serve --mode colocated`` and checks the deltas against its per-request trace.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from epdserve.bench import server_metrics as sm
from epdserve.serving.metrics import RouterMetrics
from epdserve.trace import RequestTrace

from conftest import free_port


def parse(text: str | bytes, url: str = "http://a/metrics") -> sm.Scrape:
    return sm.Scrape.parse(url, text.decode() if isinstance(text, bytes) else text)


# ------------------------------------------------------------------ quantiles


def test_histogram_quantile_interpolates_within_buckets_as_prometheus():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 9.0), (math.inf, 10.0)]
    # rank 5 of 10: bucket (0.1, 0.5] holds ranks 3..6; 0.1 + 0.4 * (5 - 2) / 4
    assert sm.histogram_quantile(0.5, buckets) == (pytest.approx(0.4), False)
    assert sm.histogram_quantile(0.1, buckets) == (pytest.approx(0.05), False)  # first bucket from 0
    assert sm.histogram_quantile(0.9, buckets) == (pytest.approx(1.0), False)
    assert sm.histogram_quantile(0.95, buckets) == (1.0, True)  # in +Inf: the highest finite bound, "≥"
    assert sm.histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) == (None, False)  # no observation
    assert sm.histogram_quantile(0.5, [(0.1, 1.0), (1.0, 2.0)]) == (None, False)  # no +Inf bucket


def test_histogram_stage_flags_a_quantile_past_the_last_bound():
    stage = sm.histogram_stage({"count": 4, "sum": 2.0, "buckets": [(0.1, 1), (0.2, 1), (math.inf, 4)]})
    assert stage["count"] == 4 and stage["mean_ms"] == pytest.approx(500.0)
    assert stage["p95_ms"] == pytest.approx(200.0) and stage["p95_at_least"]
    assert "p95 ≥200.0" in sm.stage_cell({**stage, "per_url": {}})


# ------------------------------------------------------------------ vLLM

VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0]


class FakeVLLM:
    """vLLM V1's PrometheusStatLogger metrics (names, labels model_name + engine, buckets),
    fed by hand, so ``render`` prints what vLLM's /metrics prints."""

    def __init__(self, itl_name: str = "vllm:inter_token_latency_seconds"):
        r, lab = CollectorRegistry(), ["model_name", "engine"]
        self.registry = r
        h = lambda name, b: Histogram(name, name, lab, buckets=b, registry=r)  # noqa: E731
        self.queue, self.prefill = h("vllm:request_queue_time_seconds", VLLM_LATENCY), \
            h("vllm:request_prefill_time_seconds", VLLM_LATENCY)
        self.decode, self.e2e = h("vllm:request_decode_time_seconds", VLLM_LATENCY), \
            h("vllm:e2e_request_latency_seconds", VLLM_LATENCY)
        self.ttft, self.itl = h("vllm:time_to_first_token_seconds", VLLM_TTFT), h(itl_name, VLLM_ITL)
        self.success = Counter("vllm:request_success", "", [*lab, "finished_reason"], registry=r)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "", lab, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "", lab, registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "", lab, registry=r)

    def request(self, engine: str, ttft: float, reason: str = "stop") -> None:
        labels = ("meta-llama/Llama-3.1-8B-Instruct", engine)
        for hist, v in ((self.queue, 0.01), (self.prefill, ttft - 0.01), (self.decode, 0.4),
                        (self.ttft, ttft), (self.e2e, ttft + 0.4)):
            hist.labels(*labels).observe(v)
        for _ in range(4):
            self.itl.labels(*labels).observe(0.1)
        self.success.labels(*labels, reason).inc()
        self.queries.labels(*labels).inc(100)
        self.hits.labels(*labels).inc(25)

    def render(self, url: str = "http://a/metrics") -> sm.Scrape:
        return parse(generate_latest(self.registry), url)


def test_vllm_stages_sum_over_label_sets():
    vllm = FakeVLLM()
    vllm.request("0", 0.05), vllm.request("0", 0.07)
    before = vllm.render()
    for engine, ttft, reason in (("0", 0.03, "stop"), ("1", 0.05, "length"), ("0", 0.07, "stop"),
                                 ("1", 0.3, "stop")):
        vllm.request(engine, ttft, reason)
    vllm.kv.labels("meta-llama/Llama-3.1-8B-Instruct", "0").set(0.4)
    got = sm.stages_between({"u": before}, {"u": vllm.render()})
    s = got["stages"]
    assert got["engine"] == "vllm"
    assert s["requests"]["delta"] == 4  # finished_reason "length" appeared during the run: from 0
    ttft = s["ttft"]
    assert ttft["count"] == 4 and ttft["mean_ms"] == pytest.approx(112.5)
    # cumulative run buckets: 0.04 -> 1, 0.06 -> 2, 0.08 -> 3, 0.5 -> 4
    assert ttft["p50_ms"] == pytest.approx(60.0) and ttft["p95_ms"] == pytest.approx(450.0)
    assert not ttft["p95_at_least"]
    assert s["queue"]["mean_ms"] == pytest.approx(10.0) and s["decode"]["count"] == 4
    assert s["itl"]["count"] == 16 and s["itl"]["mean_ms"] == pytest.approx(100.0)
    assert s["prefix_cache_hit_rate"]["value"] == pytest.approx(0.25)
    assert s["kv_cache_usage"]["max"] == pytest.approx(0.4)
    assert s["ttft"]["metric"] == "vllm:time_to_first_token_seconds"
    json.dumps(got)  # JSON-serializable


def test_a_split_deployment_adds_its_urls_and_keeps_each_count():
    prefill, decode = FakeVLLM(), FakeVLLM()
    before = {"p": prefill.render("p"), "d": decode.render("d")}
    for _ in range(3):
        prefill.request("0", 0.05)
    decode.request("0", 0.2)
    got = sm.stages_between(before, {"p": prefill.render("p"), "d": decode.render("d")})["stages"]
    assert got["ttft"]["count"] == 4 and got["ttft"]["per_url"] == {"p": 3, "d": 1}
    assert got["ttft"]["mean_ms"] == pytest.approx((3 * 50 + 200) / 4)
    assert got["requests"]["per_url"] == {"p": 3, "d": 1}
    assert "(p: 3, d: 1)" in sm.stage_cell(got["requests"])


def test_older_vllm_names_are_read_too():
    vllm = FakeVLLM(itl_name="vllm:time_per_output_token_seconds")
    before = vllm.render()
    vllm.request("0", 0.05)
    itl = sm.stages_between({"u": before}, {"u": vllm.render()})["stages"]["itl"]
    assert itl["metric"] == "vllm:time_per_output_token_seconds" and itl["count"] == 4


def test_histogram_series_with_different_bounds_add_on_the_shared_ones():
    r = CollectorRegistry()
    a = Histogram("x_seconds", "", ["w"], buckets=[0.1, 0.2, 0.5], registry=r)
    b_reg = CollectorRegistry()
    b = Histogram("x_seconds", "", ["w"], buckets=[0.1, 0.5], registry=b_reg)
    empty = parse("x_seconds_count 0\n")
    for v in (0.05, 0.15, 0.3):
        a.labels("a").observe(v)
        b.labels("b").observe(v)
    both = sm.histogram_delta([(empty, parse(generate_latest(reg))) for reg in (r, b_reg)], "x_seconds")
    assert both["count"] == 6 and both["buckets"] == [(0.1, 2.0), (0.5, 6.0), (math.inf, 6.0)]


# ------------------------------------------------------------------ SGLang


class FakeSGLang:
    """SGLang's TokenizerMetricsCollector and SchedulerMetricsCollector metrics (names and
    default buckets of python/sglang/srt/metrics/collector.py; label model_name)."""

    def __init__(self):
        r, lab = CollectorRegistry(), ["model_name"]
        self.registry = r
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "", lab, registry=r,
                              buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400])
        self.itl = Histogram("sglang:inter_token_latency_seconds", "", lab, registry=r,
                             buckets=[0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035,
                                      0.040, 0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000])
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "", lab, registry=r,
                             buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60])
        self.queue = Histogram("sglang:queue_time_seconds", "", lab, registry=r,
                               buckets=[0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10])
        self.requests = Counter("sglang:num_requests_total", "", lab, registry=r)
        self.token_usage = Gauge("sglang:token_usage", "", lab, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "", lab, registry=r)

    def render(self) -> sm.Scrape:
        return parse(generate_latest(self.registry))


def test_sglang_stages_and_sampled_gauges():
    sg = FakeSGLang()
    m = "meta-llama/Llama-3.1-8B-Instruct"
    sg.token_usage.labels(m).set(0.0)  # the scheduler's first log_stats
    sg.cache_hit_rate.labels(m).set(0.0)
    before = sg.render()
    rounds = []
    for usage, hit in ((0.5, 0.2), (0.3, 0.4)):
        sg.token_usage.labels(m).set(usage)
        sg.cache_hit_rate.labels(m).set(hit)
        rounds.append([sg.render()])
    for ttft in (0.15, 0.3, 0.5):
        sg.ttft.labels(m).observe(ttft)
        sg.e2e.labels(m).observe(ttft + 1)
        sg.queue.labels(m).observe(0.05)
        sg.itl.labels(m).observe(0.02)
        sg.requests.labels(m).inc()
    sg.token_usage.labels(m).set(0.1)
    got = sm.stages_between({"u": before}, {"u": sg.render()}, rounds)
    s = got["stages"]
    assert got["engine"] == "sglang" and s["requests"]["delta"] == 3
    assert s["ttft"]["mean_ms"] == pytest.approx(316.667, rel=1e-4) and s["queue"]["count"] == 3
    assert s["prefill"] is None and s["decode"] is None  # SGLang exports neither
    # samples: before 0, rounds 0.5 and 0.3, after 0.1
    assert s["kv_cache_usage"]["mean"] == pytest.approx(0.225) and s["kv_cache_usage"]["max"] == 0.5
    assert s["kv_cache_usage"]["samples"] == 4
    assert s["prefix_cache_hit_rate"]["kind"] == "gauge"
    assert s["prefix_cache_hit_rate"]["mean"] == pytest.approx((0 + 0.2 + 0.4 + 0.4) / 4)


# ------------------------------------------------------------------ llama.cpp


def llamacpp_text(prompt_tokens, cached, prompt_s, predicted, predicted_s, n_decode) -> str:
    """llama-server --metrics, as server_task_result_metrics::to_metrics writes it."""
    counters = [("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt_tokens),
                ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cached),
                ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
                ("tokens_predicted_total", "Number of generation tokens processed", predicted),
                ("tokens_predicted_seconds_total", "Total time spent generating tokens", predicted_s),
                ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding "
                 "and multimodal decoding", n_decode)]
    gauges = [("prompt_tokens_seconds", "Average prompt throughput in tokens/s", 500),
              ("requests_processing", "Number of requests processing", 0),
              ("requests_deferred", "Number of requests deferred", 0)]
    return "".join(f"# HELP llamacpp:{name} {desc}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
                   for kind, items in (("counter", counters), ("gauge", gauges)) for name, desc, value in items)


def test_llamacpp_stages_derived_from_its_counters():
    before = parse(llamacpp_text(1000, 0, 2.0, 500, 10.0, 700))
    after = parse(llamacpp_text(1400, 100, 2.8, 540, 10.72, 740))
    got = sm.stages_between({"u": before}, {"u": after}, completed_requests=4)
    s = got["stages"]
    assert got["engine"] == "llama.cpp"
    assert s["requests"] is None and s["ttft"] is None and s["queue"] is None and s["e2e"] is None
    assert s["prefill"]["mean_ms"] == pytest.approx(200.0) and s["prefill"]["per_token_ms"] == pytest.approx(2.0)
    assert s["prefill"]["requests_from"] == "client"
    assert s["decode"]["mean_ms"] == pytest.approx(180.0) and s["decode"]["per_token_ms"] == pytest.approx(18.0)
    assert s["itl"]["mean_ms"] == pytest.approx(0.72 / 36 * 1000)  # 40 tokens of 4 requests: 36 gaps
    assert s["prefix_cache_hit_rate"]["value"] == pytest.approx(100 / 500)
    assert s["kv_cache_usage"] is None  # only older llama.cpp had kv_cache_usage_ratio
    # without the client's count: the total and the per-token time only
    alone = sm.stages_between({"u": before}, {"u": after})["stages"]["prefill"]
    assert alone["mean_ms"] is None and sm.stage_cell(alone) == "Σ 0.80 s; 2.0 ms/token"


def test_counters_without_type_lines_and_a_restart():
    untyped = lambda text: "\n".join(x for x in text.splitlines() if not x.startswith("#"))  # noqa: E731
    before = parse(untyped(llamacpp_text(1000, 0, 2.0, 500, 10.0, 700)))
    restarted = parse(untyped(llamacpp_text(300, 0, 0.5, 20, 0.4, 30)))  # lower: counting anew
    assert sm.counter_delta(before, restarted, "llamacpp:prompt_tokens") == 300
    assert sm.counter_delta(before, restarted, "llamacpp:prompt_seconds") == pytest.approx(0.5)


# ------------------------------------------------------------------ epdserve


def epd_record(i: int, **stages) -> RequestTrace:
    return RequestTrace(request_id=f"r{i}", mode="colocated", path="colocated", prompt_tokens=10,
                        output_tokens=3, finish_reason="stop", **stages)


def test_epdserve_stages_leave_the_router_queue_out():
    metrics = RouterMetrics()
    before = parse(metrics.render())
    for i, q in enumerate((2.0, 4.0)):
        metrics.finished(epd_record(i, router_queue_ms=1.0, colocated_queue_ms=q, prefill_ms=30.0,
                                    decode_ms=20.0, ttft_ms=35.0, e2e_ms=55.0), [0.01, 0.01])
    metrics.set_worker("w0", "colocated", blocks_in_use=3, blocks_total=12, num_running=1, num_waiting=0,
                       num_preemptions=0, prefix_cache_queries=40, prefix_cache_hits=10)
    s = sm.stages_between({"u": before}, {"u": parse(metrics.render())})["stages"]
    assert s["queue"]["count"] == 2 and s["queue"]["mean_ms"] == pytest.approx(3.0)
    assert s["requests"]["delta"] == 2 and s["ttft"]["mean_ms"] == pytest.approx(35.0)
    assert s["itl"]["count"] == 4 and s["prefix_cache_hit_rate"]["value"] == pytest.approx(0.25)
    assert s["kv_cache_usage"]["max"] == pytest.approx(0.25)


# ------------------------------------------------------------------ the report


def test_the_table_has_a_dash_where_an_engine_has_no_stage():
    vllm = FakeVLLM()
    before = vllm.render()
    vllm.request("0", 0.05)
    llama = sm.stages_between({"u": parse(llamacpp_text(0, 0, 0, 0, 0, 0))},
                              {"u": parse(llamacpp_text(100, 0, 0.2, 10, 0.3, 12))}, completed_requests=1)
    entries = [{"name": "vllm-1p1d", "server_metrics": {**sm.stages_between({"u": before}, {"u": vllm.render()}),
                                                        "warnings": []}},
               {"name": "llama-server", "server_metrics": {**llama, "warnings": ["metrics before the run: x"]}},
               {"name": "broken", "error": "never ready"}]
    md = sm.stages_markdown(entries)
    header, rows = sm.stages_table(entries)
    assert header == ["Stage", "vllm-1p1d", "llama-server", "broken"]
    ttft = next(r for r in rows if r[0].startswith("TTFT"))
    assert ttft[1].startswith("50.0 (p50") and ttft[2] == "—" and ttft[3] == "—"
    assert "| TTFT, mean (p50, p95) ms |" in md
    assert "- llama.cpp, prefill time: `llamacpp:prompt_seconds`" in md
    assert "- warning [llama-server]: metrics before the run: x" in md
    assert sm.stages_text(entries).splitlines()[0].startswith("Stage")
    assert sm.stages_markdown([{"name": "x", "error": "e"}]) == ""


# ------------------------------------------------------------------ scraping over HTTP


class Pages(ThreadingHTTPServer):
    """A real HTTP server answering ``pages[path] = (status, body)``."""

    def __init__(self, pages: dict[str, tuple[int, str]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.pages = pages
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        status, body = self.server.pages.get(self.path, (404, "not found"))
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def pages():
    server = Pages({"/metrics": (200, llamacpp_text(1, 0, 0.1, 1, 0.1, 1)),
                    "/html": (200, "<html><body>hello</body></html>"),
                    "/off": (501, '{"error": {"message": "This server does not support metrics endpoint."}}')})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_scrape_errors_are_one_clear_line(pages):
    assert "llamacpp:prompt_tokens_total" in sm.scrape(pages.url + "/metrics").samples
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    for url, says in ((dead, "cannot connect"), (pages.url + "/off", "HTTP 501"),
                      (pages.url + "/nothing", "HTTP 404"), (pages.url + "/html", "not Prometheus text")):
        with pytest.raises(sm.MetricsUnavailable) as err:
            sm.scrape(url, timeout_s=5)
        assert str(err.value).startswith(url) and says in str(err.value) and "\n" not in str(err.value)


def test_watcher_samples_gauges_and_settles_over_http(pages):
    watcher = sm.MetricsWatcher([pages.url + "/metrics"], interval_s=0.05, settle_s=1.0).start()
    pages.pages["/metrics"] = (200, llamacpp_text(41, 0, 0.5, 11, 1.1, 12))
    deadline = time.monotonic() + 10
    while len(watcher.rounds) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    got = watcher.stop(completed_requests=2)
    assert got["engine"] == "llama.cpp" and got["warnings"] == []
    assert got["stages"]["prefill"]["mean_ms"] == pytest.approx(200.0)
    assert got["stages"]["decode"]["mean_ms"] == pytest.approx(500.0)


# ------------------------------------------------------------------ a real epdserve deployment

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
           "Name three colours:", "Once upon a time"]
# the per-request trace's mean, for each stage whose histogram observes it
TRACE_KEYS = {"queue": "queue_ms", "prefill": "prefill_ms", "decode": "decode_ms", "ttft": "ttft_ms",
              "e2e": "e2e_ms"}


def test_prometheus_deltas_of_epdserve_count_every_request_and_match_its_trace(colocated_server):
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    watcher = sm.MetricsWatcher([colocated_server.url + "/metrics", dead], interval_s=0.2).start()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: colocated_server.generate(
                "completion", p, stream=True, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}),
                PROMPTS))
    finally:
        got = watcher.stop()  # at once: stop() itself waits for the server to record the last ones
    n, s = len(PROMPTS), got["stages"]
    assert got["engine"] == "epdserve"
    assert s["ttft"]["count"] == n and s["e2e"]["count"] == n and s["requests"]["delta"] == n
    assert s["ttft"]["per_url"] == {colocated_server.url + "/metrics": n}  # the dead URL left out
    assert any(dead in w and "cannot connect" in w for w in got["warnings"])
    records = [RequestTrace.from_json(colocated_server.trace(r.id)) for r in results]
    assert s["itl"]["count"] == sum(r.output_tokens - 1 for r in records)
    for stage, key in TRACE_KEYS.items():
        trace_mean = float(np.mean([getattr(r, key) for r in records]))
        assert s[stage]["count"] == n, stage
        assert s[stage]["mean_ms"] == pytest.approx(trace_mean, rel=0.10), stage
    usage = s["kv_cache_usage"]
    assert usage["samples"] >= 2 and 0 <= usage["mean"] <= usage["max"] <= 1


def test_a_watcher_of_dead_urls_gives_none_stages_and_warnings():
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    got = sm.MetricsWatcher([dead], interval_s=0.05).start().stop()
    assert got["engine"] is None and all(v is None for v in got["stages"].values())
    assert len(got["warnings"]) == 1 and "cannot connect" in got["warnings"][0]
    assert sm.stages_text([{"name": "x", "server_metrics": got}]).count("—") == len(sm.STAGES)
