"""Prometheus metrics of the router, in a registry of its own (not the global default),
so that several routers can live in one process (tests).

Names and buckets follow vLLM's ``vllm:*`` metrics (``vllm/v1/metrics/loggers.py``) with the
``epdserve:`` prefix. Times are in seconds, sizes in bytes. Per-worker gauges carry
``worker`` and ``role`` labels and are set from the workers'
:class:`~epdserve.serving.protocol.Stats`. The per-request histograms are observed from
the request's trace record (:meth:`~epdserve.serving.router.flows.Flow.trace`) when it
ends, so that /metrics and ``--trace-file`` agree; a stage time splits by ``stage`` (where
the request waited: router, colocated, prefill or decode worker) or ``role`` (the worker
role that ran it; a decode-role prefill is a pd request under the local-prefill threshold).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epdserve.trace import RequestTrace

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's request_latency_buckets: e2e, queue, prefill and decode time.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's buckets for time per output token and inter-token latency.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 5.0, 10.0)
KV_BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(0, 12))  # 1 KiB .. 4 GiB

# The worker role that prefills / decodes a request, by its trace record's ``path``.
PREFILL_ROLE = {"colocated": "colocated", "disaggregated": "prefill", "local": "decode"}
DECODE_ROLE = {"colocated": "colocated", "disaggregated": "decode", "local": "decode"}


class RouterMetrics:
    """All router metrics; :meth:`render` gives the Prometheus text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self._worker_metrics(r)
        self._totals_seen: dict[tuple[str, str], tuple[int, ...]] = {}  # last worker-reported totals
        self._request_metrics(r)

    def _worker_metrics(self, r: CollectorRegistry) -> None:
        """The per-worker gauges and counters (labels ``worker``, ``role``)."""
        wl = ["worker", "role"]
        self.worker_up = Gauge("epdserve:worker_up", "1 if the worker is up, 0 if down or refused.", wl, registry=r)
        self.kv_blocks_in_use = Gauge("epdserve:kv_blocks_in_use", "KV cache blocks in use.", wl, registry=r)
        self.kv_blocks_total = Gauge("epdserve:kv_blocks_total", "KV cache blocks in the pool.", wl, registry=r)
        self.num_requests_running = Gauge("epdserve:num_requests_running",
                                          "Requests in the worker's running batch.", wl, registry=r)
        self.num_requests_waiting = Gauge("epdserve:num_requests_waiting",
                                          "Requests waiting in the worker's queue.", wl, registry=r)
        # vLLM v1's vllm:kv_cache_usage_perc: a fraction, 1 = every block in use.
        self.kv_cache_usage = Gauge("epdserve:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                                    wl, registry=r)
        # vLLM's vllm:num_preemptions (a counter, exposed as ..._total).
        self.num_preemptions = Counter("epdserve:num_preemptions", "Requests preempted (recompute).",
                                       wl, registry=r)
        # vLLM's vllm:prefix_cache_queries / vllm:prefix_cache_hits (counters, tokens).
        self.prefix_cache_queries = Counter("epdserve:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", wl, registry=r)
        self.prefix_cache_hits = Counter("epdserve:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.", wl, registry=r)
        # vLLM's vllm:mm_cache_queries / vllm:mm_cache_hits: images looked up in / found in
        # a worker's embedding cache (encode workers, and workers that encode in-process).
        self.mm_cache_queries = Counter("epdserve:mm_cache_queries", "Images looked up in the embedding cache.",
                                        wl, registry=r)
        self.mm_cache_hits = Counter("epdserve:mm_cache_hits", "Images found in the embedding cache.",
                                     wl, registry=r)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """The per-request counters and histograms."""
        self.request_success = Counter("epdserve:request_success_total",
                                       "Finished requests by finish reason (abort = client went away).",
                                       ["finish_reason"], registry=r)
        self.request_failure = Counter("epdserve:request_failure_total",
                                       "Requests that failed after admission (worker error, timeout, no worker).",
                                       registry=r)
        self.bad_request = Counter("epdserve:bad_request_total", "Requests answered with HTTP 400.", registry=r)
        self.prompt_tokens = Counter("epdserve:prompt_tokens_total", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter("epdserve:generation_tokens_total", "Generated tokens.", registry=r)
        self.ttft = Histogram("epdserve:time_to_first_token_seconds",
                              "Arrival at the router to the first token back from a worker.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("epdserve:e2e_request_latency_seconds",
                             "Arrival at the router to the last token.", buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("epdserve:request_queue_time_seconds",
                                    "Time waiting: at the router (arrival to dispatch) or at a worker "
                                    "(arrival to first scheduled).", ["stage"], buckets=E2E_BUCKETS, registry=r)
        self.prefill_time = Histogram("epdserve:request_prefill_time_seconds",
                                      "First scheduled to first token on the worker that prefilled.",
                                      ["role"], buckets=E2E_BUCKETS, registry=r)
        self.decode_time = Histogram("epdserve:request_decode_time_seconds",
                                     "First token to last token on the worker that decoded (an imported "
                                     "request: from first scheduled).", ["role"], buckets=E2E_BUCKETS, registry=r)
        self.tpot = Histogram("epdserve:time_per_output_token_seconds",
                              "First to last token at the router over the tokens after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("epdserve:inter_token_latency_seconds",
                             "Time between two consecutive tokens reaching the router.",
                             buckets=TPOT_BUCKETS, registry=r)
        self.kv_transfer_seconds = Histogram("epdserve:kv_transfer_seconds",
                                             "KV export + router hop + KV import, per PD request.",
                                             buckets=KV_SECONDS_BUCKETS, registry=r)
        self.kv_transfer_bytes = Histogram("epdserve:kv_transfer_bytes", "KV cache bytes per PD request.",
                                           buckets=KV_BYTES_BUCKETS, registry=r)

    def set_worker(self, worker: str, role: str, *, blocks_in_use: int, blocks_total: int,
                   num_running: int, num_waiting: int, num_preemptions: int,
                   prefix_cache_queries: int = 0, prefix_cache_hits: int = 0, mm_cache_queries: int = 0,
                   mm_cache_hits: int = 0) -> None:
        """Update one worker's gauges and counters from its Stats, whose preemption,
        prefix-cache and embedding-cache numbers are the worker's totals since it started
        (a worker that restarted reports smaller totals: its counters go on from the new totals)."""
        self.kv_blocks_in_use.labels(worker, role).set(blocks_in_use)
        self.kv_blocks_total.labels(worker, role).set(blocks_total)
        self.kv_cache_usage.labels(worker, role).set(blocks_in_use / blocks_total if blocks_total else 0.0)
        self.num_requests_running.labels(worker, role).set(num_running)
        self.num_requests_waiting.labels(worker, role).set(num_waiting)
        totals = (num_preemptions, prefix_cache_queries, prefix_cache_hits, mm_cache_queries, mm_cache_hits)
        counters = (self.num_preemptions, self.prefix_cache_queries, self.prefix_cache_hits, self.mm_cache_queries,
                    self.mm_cache_hits)
        seen = self._totals_seen.get((worker, role), (0,) * len(totals))
        if any(now < before for now, before in zip(totals, seen)):
            seen = (0,) * len(totals)
        for counter, now, before in zip(counters, totals, seen):
            counter.labels(worker, role).inc(now - before)
        self._totals_seen[(worker, role)] = totals

    def finished(self, rec: RequestTrace, itls_s: list[float]) -> None:
        """Record one request that ended without an error.

        ``rec``: its trace record (ms; see :mod:`epdserve.trace`); ``itls_s``: the gaps
        between its outputs (one token each) reaching the router, in seconds. TPOT is
        their mean, as vLLM's (decode time / (output tokens - 1)).
        """
        self.request_success.labels(rec.finish_reason or "abort").inc()
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.output_tokens)
        if rec.ttft_ms is not None:
            self.ttft.observe(rec.ttft_ms / 1000)
        self.e2e.observe(rec.e2e_ms / 1000)
        for ms, stage in ((rec.router_queue_ms, "router"), (rec.prefill_queue_ms, "prefill"),
                          (rec.decode_queue_ms, "decode"), (rec.colocated_queue_ms, "colocated")):
            if ms is not None:
                self.queue_time.labels(stage).observe(ms / 1000)
        if rec.prefill_ms is not None:
            self.prefill_time.labels(PREFILL_ROLE[rec.path]).observe(rec.prefill_ms / 1000)
        if rec.decode_ms is not None:
            self.decode_time.labels(DECODE_ROLE[rec.path]).observe(rec.decode_ms / 1000)
        for gap in itls_s:
            self.itl.observe(gap)
        if itls_s:
            self.tpot.observe(sum(itls_s) / len(itls_s))
        if rec.kv_transfer_ms:  # a hand-off happened (colocated records carry 0)
            self.kv_transfer_seconds.observe(rec.kv_transfer_ms / 1000)
            self.kv_transfer_bytes.observe(rec.kv_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)
