"""The router's Prometheus metrics, in a registry of its own (tests run several routers): ``vllm:`` (vLLM V1's
names, labels, buckets: the deployment as one server) and ``epdserve:`` (per worker and stage, and our own);
seconds and bytes. Every series, its labels and ``engine``: docs/architecture.md, "Prometheus"."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.trace import RequestTrace

METRICS_PREFIXES = ("both", "vllm", "epdserve")
DEFAULT_METRICS_PREFIX = "both"

# vLLM's buckets (vllm/v1/metrics/loggers.py); E2E: its request_latency_buckets, TPOT: ITL and TPOT.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 5.0, 10.0)
KV_BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(0, 12))  # 1 KiB .. 4 GiB
DRAIN_BUCKETS = (0.001, 0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 120.0, 300.0)

PREFILL_ROLE = {"colocated": "colocated", "disaggregated": "prefill", "local": "decode"}
DECODE_ROLE = {"colocated": "colocated", "disaggregated": "decode", "local": "decode"}
WORKER_TOTALS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "mm_cache_queries",
                 "mm_cache_hits")
# Open n > 1 requests kept (the oldest dropped): a choice that never ends must not grow this.
MAX_OPEN_PARALLEL = 65536
# vLLM's FinishReason (vllm/v1/engine/__init__.py); abort: the client went away; error: a worker failed it
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
ROUTER_ENGINE = "router"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, ... up to ``max_value`` inclusive, at least ``(1,)``: vLLM's (loggers.py)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out) or (1,)
            out.append(m * scale)
        scale *= 10


class _Series:
    """A metric whose series carry ``model_name`` and ``engine`` (its ``worker`` label, else
    :data:`ROUTER_ENGINE`) before its own labels, the only ones its methods take."""

    def __init__(self, metrics: RouterMetrics, cls, name: str, doc: str, labels=(), **kw):
        self.metric = cls(name, doc, ["model_name", "engine", *labels], registry=metrics.registry, **kw)
        self.model = metrics.model_name
        self.worker = list(labels).index("worker") if "worker" in labels else None

    def _values(self, values: tuple) -> tuple:
        return (self.model, ROUTER_ENGINE if self.worker is None else values[self.worker], *values)

    def labels(self, *values):
        return self.metric.labels(*self._values(values))

    def remove(self, *values) -> None:
        self.metric.remove(*self._values(values))


class _Named:
    """One vLLM-named metric as ``vllm:NAME`` and ``epdserve:NAME``, of the prefixes enabled."""

    def __init__(self, metrics: RouterMetrics, cls, name: str, doc: str, vllm_labels=(), epd_labels=(), **kw):
        def make(prefix: str, labels) -> _Series | None:
            if prefix not in metrics.prefixes:
                return None
            return _Series(metrics, cls, f"{prefix}:{name}", doc, labels, **kw)

        self.vllm = make("vllm", vllm_labels)
        self.epd = make("epdserve", epd_labels)
        # at 0 from the start, as vLLM's: a scraper finds every name before the first request
        for metric, labels in ((self.vllm, vllm_labels), (self.epd, epd_labels)):
            if metric is not None and not labels:
                metric.labels()

    def children(self, vllm: tuple = (), epd: tuple = (), views: str = "both") -> list:
        out = []
        if self.vllm is not None and views in ("both", "vllm"):
            out.append(self.vllm.labels(*vllm))
        if self.epd is not None and views in ("both", "epdserve"):
            out.append(self.epd.labels(*epd))
        return out

    def observe(self, value: float, **kw) -> None:
        for child in self.children(**kw):
            child.observe(value)

    def inc(self, value: float = 1.0, **kw) -> None:
        for child in self.children(**kw):
            child.inc(value)

    def set(self, value: float, **kw) -> None:
        for child in self.children(**kw):
            child.set(value)


class RouterMetrics:
    """``max_model_len`` (tokens): the top of the token-count buckets, as vLLM sizes them. Raises
    ValueError for a ``prefix`` not in :data:`METRICS_PREFIXES`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "epdserve", prefix: str = DEFAULT_METRICS_PREFIX,
                 max_model_len: int = 8192) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix {prefix!r}: expected one of {', '.join(METRICS_PREFIXES)}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefixes = ("vllm", "epdserve") if prefix == "both" else (prefix,)
        self._workers: dict[tuple[str, str], dict] = {}  # last Stats of each live worker
        self._totals_seen: dict[tuple[str, str], tuple[int, ...]] = {}  # last worker-reported totals
        self._parallel: dict[str, list[int]] = {}  # n > 1 requests: [n, choices left, most tokens]
        self._own_metrics()
        self._worker_metrics()
        self._request_metrics()
        self._token_metrics(max_model_len)
        for reason in FINISHED_REASONS:  # up front, as vLLM
            self.request_success.children(vllm=(reason,), epd=(reason,))
        self._set_deployment_gauges()

    def _own_metrics(self) -> None:
        def series(cls, name: str, doc: str, labels=(), **kw) -> _Series:
            return _Series(self, cls, f"epdserve:{name}", doc, labels, **kw)

        wl = ("worker", "role")
        self._worker_up = series(Gauge, "worker_up", "1 if the worker is up, 0 if down or refused.", wl)
        # kube-state-metrics' *_info convention: join on ``worker``, other series keep their labels
        self._worker_node = series(Gauge, "worker_node_info", "1 per worker and the node it runs on "
                                   "(Ray node id or host name, and its IP).", (*wl, "node", "node_ip"))
        self._nodes: dict[tuple[str, str], tuple[str, str]] = {}  # (worker, role) -> its (node, node_ip)
        self._worker_role = series(Gauge, "worker_role", "1 for the role the router routes to the worker by, "
                                   "0 for the other engine roles.", wl)
        self._roles: dict[str, str] = {}  # worker -> its role now
        self.role_switches = series(Counter, "role_switches", "Role switches a worker announced (elastic).",
                                    ("worker", "from_role", "to_role"))
        self.role_switch_drain = series(Histogram, "role_switch_drain_seconds", "From a worker's receipt of a "
                                        "role switch to its announcement: the time its old role's work took to "
                                        "finish.", buckets=DRAIN_BUCKETS).labels()
        self._worker_states = series(Gauge, "workers", "Engine workers by state (elastic: live, starting, "
                                     "retiring).", ("state",))
        self._scale = series(Counter, "worker_scale", "Workers added (out) or retired (in), by the elastic "
                             "controller or by hand.", ("direction",))
        self.kv_blocks_in_use = series(Gauge, "kv_blocks_in_use", "KV cache blocks in use.", wl)
        self.kv_blocks_total = series(Gauge, "kv_blocks_total", "KV cache blocks in the pool.", wl)
        self.request_failure = series(Counter, "request_failure_total", "Requests that failed after admission "
                                      "(worker error, timeout, no worker).").labels()
        self.bad_request = series(Counter, "bad_request_total", "Requests answered with HTTP 400.").labels()
        self.migrations = series(Counter, "request_migrations_total", "Moves of a request whose worker died "
                                 "mid-stream to a live worker (--migration-limit).").labels()
        self.routed = series(Counter, "routed_requests_total", "Requests routed to their first worker, by routing "
                             "policy, whether the worker's prefix cache hit, and whether the router believed it "
                             "would.", ("policy", "hit", "believed"))
        self.kv_transfer_seconds = series(Histogram, "kv_transfer_seconds", "KV export + router hop + KV import, "
                                          "per PD request.", buckets=KV_SECONDS_BUCKETS).labels()
        self.kv_transfer_bytes = series(Histogram, "kv_transfer_bytes", "KV cache bytes per PD request.",
                                        buckets=KV_BYTES_BUCKETS).labels()

    def _worker_metrics(self) -> None:
        wl = ("worker", "role")
        self.num_requests_running = _Named(self, Gauge, "num_requests_running",
                                           "Requests in model execution batches.", epd_labels=wl)
        self.num_requests_waiting = _Named(self, Gauge, "num_requests_waiting",
                                           "Requests waiting to be processed.", epd_labels=wl)
        self.kv_cache_usage = _Named(self, Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                     epd_labels=wl)
        self.gpu_cache_usage = _Series(self, Gauge, "vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 "
                                       "percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.") \
            if "vllm" in self.prefixes else None
        docs = {"num_preemptions": "Cumulative number of preemptions (recompute).",
                "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
                "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
                "mm_cache_queries": "Multi-modal cache queries, in terms of number of queried images.",
                "mm_cache_hits": "Multi-modal cache hits, in terms of number of cached images."}
        self._total_counters = [_Named(self, Counter, name, docs[name], epd_labels=wl) for name in WORKER_TOTALS]
        self.iteration_tokens = _Named(self, Histogram, "iteration_tokens_total",
                                       "Histogram of number of tokens per engine_step.", epd_labels=wl,
                                       buckets=ITERATION_TOKENS_BUCKETS)
        # no adapters, said to gateways whose LoRA affinity reads it (vLLM: only with LoRA on)
        self.lora_info = _Series(self, Gauge, "vllm:lora_requests_info", "Running stats on lora requests.",
                                 ("max_lora", "running_lora_adapters", "waiting_lora_adapters")) \
            if "vllm" in self.prefixes else None

    def _request_metrics(self) -> None:
        self.request_success = _Named(self, Counter, "request_success",
                                      "Count of processed requests by finish reason (abort: the client went away; "
                                      "error: a worker failed it).",
                                      vllm_labels=("finished_reason",), epd_labels=("finished_reason",))
        self.prompt_tokens = _Named(self, Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = _Named(self, Counter, "generation_tokens", "Number of generation tokens processed.")
        self.ttft = _Named(self, Histogram, "time_to_first_token_seconds",
                           "Arrival at the router to the first token back from a worker.", buckets=TTFT_BUCKETS)
        self.e2e = _Named(self, Histogram, "e2e_request_latency_seconds", "Arrival at the router to the last token.",
                          buckets=E2E_BUCKETS)
        self.queue_time = _Named(self, Histogram, "request_queue_time_seconds",
                                 "Time waiting in worker queues (arrival to first scheduled; PD: prefill + decode); "
                                 "epdserve: by stage, the router's own wait included.", epd_labels=("stage",),
                                 buckets=E2E_BUCKETS)
        self.prefill_time = _Named(self, Histogram, "request_prefill_time_seconds",
                                   "First scheduled to first token on the worker that prefilled.",
                                   epd_labels=("role",), buckets=E2E_BUCKETS)
        self.decode_time = _Named(self, Histogram, "request_decode_time_seconds",
                                  "First token to last token on the worker that decoded (an imported request: "
                                  "from first scheduled).", epd_labels=("role",), buckets=E2E_BUCKETS)
        self.inference_time = _Named(self, Histogram, "request_inference_time_seconds",
                                     "Time running on workers: prefill time + decode time.", buckets=E2E_BUCKETS)
        self.itl = _Named(self, Histogram, "inter_token_latency_seconds",
                          "Time between two consecutive outputs reaching the router.", buckets=TPOT_BUCKETS)
        self.tpot = _Named(self, Histogram, "request_time_per_output_token_seconds",
                           "Per request: first to last token at the router over the tokens after the first.",
                           buckets=TPOT_BUCKETS)

    def _token_metrics(self, max_model_len: int) -> None:
        tokens = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = _Named(self, Histogram, "request_prompt_tokens",
                                            "Number of prefill tokens processed.", buckets=tokens)
        self.request_generation_tokens = _Named(self, Histogram, "request_generation_tokens",
                                                "Number of generation tokens processed.", buckets=tokens)
        self.request_max_tokens = _Named(self, Histogram, "request_params_max_tokens",
                                         "Histogram of the max_tokens request parameter.", buckets=tokens)
        self.request_n = _Named(self, Histogram, "request_params_n", "Histogram of the n request parameter.",
                                buckets=N_BUCKETS)
        self.request_max_generation = _Named(self, Histogram, "request_max_num_generation_tokens",
                                             "Histogram of maximum number of requested generation tokens.",
                                             buckets=tokens)

    def set_worker_up(self, worker: str, role: str, up: bool) -> None:
        self._worker_up.labels(worker, role).set(1 if up else 0)
        if not up and self._workers.pop((worker, role), None) is not None:
            self._set_deployment_gauges()

    def set_role(self, worker: str, role: str) -> None:
        previous = self._roles.get(worker)
        if previous is not None and previous != role:
            self._leave_role(worker, previous, role)
        self._roles[worker] = role
        for r in dict.fromkeys((*ENGINE_ROLES, role)):  # an encode worker's too
            self._worker_role.labels(worker, r).set(1 if r == role else 0)

    def _leave_role(self, worker: str, previous: str, role: str) -> None:
        """Gauges under ``previous`` go (they would read as held forever); counters stay (what it did)."""
        old = (worker, previous)
        for gauge in (self.kv_blocks_in_use, self.kv_blocks_total):
            gauge.remove(*old)
        for named in (self.kv_cache_usage, self.num_requests_running, self.num_requests_waiting):
            if named.epd is not None:
                named.epd.remove(*old)
        if (worker, previous) in self._totals_seen:
            self._totals_seen[(worker, role)] = self._totals_seen.pop((worker, previous))
        if (node := self._nodes.pop((worker, previous), None)) is not None:
            self._worker_node.remove(*old, *node)
            self.set_worker_node(worker, role, *node)

    def set_worker_states(self, live: int, starting: int, retiring: int) -> None:
        for state, n in (("live", live), ("starting", starting), ("retiring", retiring)):
            self._worker_states.labels(state).set(n)

    def scaled(self, direction: str) -> None:
        self._scale.labels(direction).inc()

    def role_switched(self, worker: str, previous: str, role: str, drain_s: float) -> None:
        self.role_switches.labels(worker, previous, role).inc()
        self.role_switch_drain.observe(drain_s)

    def set_worker_node(self, worker: str, role: str, node: str, node_ip: str) -> None:
        old = self._nodes.get((worker, role))
        if old is not None and old != (node, node_ip):
            self._worker_node.remove(worker, role, *old)
        self._nodes[(worker, role)] = (node, node_ip)
        self._worker_node.labels(worker, role, node, node_ip).set(1)

    def set_worker(self, worker: str, role: str, *, blocks_in_use: int, blocks_total: int,
                   num_running: int, num_waiting: int, num_preemptions: int = 0,
                   prefix_cache_queries: int = 0, prefix_cache_hits: int = 0, mm_cache_queries: int = 0,
                   mm_cache_hits: int = 0, num_steps: int = 0, last_step_tokens: int = 0) -> None:
        """From its Stats: totals since the worker started (smaller after a restart: counted on from
        there); a new ``num_steps`` observes ``last_step_tokens`` in ``iteration_tokens_total``."""
        epd = (worker, role)
        self.kv_blocks_in_use.labels(*epd).set(blocks_in_use)
        self.kv_blocks_total.labels(*epd).set(blocks_total)
        usage = blocks_in_use / blocks_total if blocks_total else 0.0
        self.kv_cache_usage.set(usage, epd=epd, views="epdserve")
        self.num_requests_running.set(num_running, epd=epd, views="epdserve")
        self.num_requests_waiting.set(num_waiting, epd=epd, views="epdserve")
        totals = (num_preemptions, prefix_cache_queries, prefix_cache_hits, mm_cache_queries, mm_cache_hits,
                  num_steps)
        seen = self._totals_seen.get(epd, (0,) * len(totals))
        if any(now < before for now, before in zip(totals, seen)):
            seen = (0,) * len(totals)
        for counter, now, before in zip(self._total_counters, totals[:-1], seen):
            counter.inc(now - before, epd=epd)
        if num_steps > seen[-1] and last_step_tokens:
            self.iteration_tokens.observe(last_step_tokens, epd=epd)
        self._totals_seen[epd] = totals
        self._workers[epd] = {"blocks_in_use": blocks_in_use, "blocks_total": blocks_total,
                              "num_running": num_running, "num_waiting": num_waiting}
        self._set_deployment_gauges()

    def _set_deployment_gauges(self) -> None:
        if "vllm" not in self.prefixes:
            return
        live = self._workers.values()
        self.num_requests_running.set(sum(w["num_running"] for w in live), views="vllm")
        self.num_requests_waiting.set(sum(w["num_waiting"] for w in live), views="vllm")
        total = sum(w["blocks_total"] for w in live)
        usage = sum(w["blocks_in_use"] for w in live) / total if total else 0.0
        self.kv_cache_usage.set(usage, views="vllm")
        self.gpu_cache_usage.labels().set(usage)
        # as vLLM: when last recorded (gateways take the newest)
        self.lora_info.labels("0", "", "").set(time.time())

    def admitted(self, request_id: str, n: int) -> None:
        """n > 1: engine requests ``<request_id>-<i>``, observed in ``request_params_n`` and
        ``request_max_num_generation_tokens`` once all have ended (per parent request, as vLLM)."""
        if n > 1:
            self._parallel[request_id] = [n, n, 0]
            if len(self._parallel) > MAX_OPEN_PARALLEL:
                del self._parallel[next(iter(self._parallel))]

    def ended(self, rec: RequestTrace, itls_s: list[float] | None) -> None:
        """One engine request: ``itls_s`` (s) its output gaps at the router, None if it failed
        (``finished_reason="error"``, as vLLM, and ``request_failure_total``)."""
        if rec.routing is not None and rec.cached_tokens is not None:
            believed = "none" if rec.routing_believed_tokens is None else str(rec.routing_believed_tokens > 0).lower()
            self.routed.labels(rec.routing, str(rec.cached_tokens > 0).lower(), believed).inc()
        self.migrations.inc(len(rec.migrations or []))
        if itls_s is None:
            self.request_failure.inc()
            self.request_success.inc(vllm=("error",), epd=("error",))
        else:
            self.finished(rec, itls_s)
        parent, _, _ = rec.request_id.rpartition("-")
        group = self._parallel.get(parent)
        if group is None:
            n, most = 1, rec.output_tokens
        else:
            group[1] -= 1
            group[2] = max(group[2], rec.output_tokens)
            if group[1] > 0:
                return
            del self._parallel[parent]
            n, _, most = group
        self.request_n.observe(n)
        self.request_max_generation.observe(most)

    def finished(self, rec: RequestTrace, itls_s: list[float]) -> None:
        """``rec`` in ms; TPOT: the mean of ``itls_s`` (s), as vLLM's decode time / (output tokens - 1)."""
        self.request_success.inc(vllm=(rec.finish_reason or "abort",), epd=(rec.finish_reason or "abort",))
        self.prompt_tokens.inc(rec.prompt_tokens)
        self.generation_tokens.inc(rec.output_tokens)
        self.request_prompt_tokens.observe(rec.prompt_tokens)
        self.request_generation_tokens.observe(rec.output_tokens)
        self.request_max_tokens.observe(rec.max_tokens)
        if rec.ttft_ms is not None:
            self.ttft.observe(rec.ttft_ms / 1000)
        self.e2e.observe(rec.e2e_ms / 1000)
        self._stage_times(rec)
        for gap in itls_s:
            self.itl.observe(gap)
        if itls_s:
            self.tpot.observe(sum(itls_s) / len(itls_s))
        if rec.kv_transfer_ms:  # colocated records carry 0
            self.kv_transfer_seconds.observe(rec.kv_transfer_ms / 1000)
            self.kv_transfer_bytes.observe(rec.kv_bytes)

    def _stage_times(self, rec: RequestTrace) -> None:
        """``vllm:`` queue time: the worker queues (vLLM's engine queue); ``epdserve:``: by stage."""
        for ms, stage in ((rec.router_queue_ms, "router"), (rec.prefill_queue_ms, "prefill"),
                          (rec.decode_queue_ms, "decode"), (rec.colocated_queue_ms, "colocated")):
            if ms is not None:
                self.queue_time.observe(ms / 1000, epd=(stage,), views="epdserve")
        if rec.queue_ms is not None:
            self.queue_time.observe(rec.queue_ms / 1000, views="vllm")
        if rec.prefill_ms is not None:
            self.prefill_time.observe(rec.prefill_ms / 1000, epd=(PREFILL_ROLE[rec.path],))
        if rec.decode_ms is not None:
            self.decode_time.observe(rec.decode_ms / 1000, epd=(DECODE_ROLE[rec.path],))
        if rec.prefill_ms is not None and rec.decode_ms is not None:
            self.inference_time.observe((rec.prefill_ms + rec.decode_ms) / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def add_metrics_options(parser) -> None:
    parser.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default=DEFAULT_METRICS_PREFIX,
                        help="names on /metrics: vllm (vLLM's vllm:* names, labels and meanings, the deployment "
                             "as one server: vLLM's Grafana dashboard and gateway scrapers read them), epdserve "
                             "(the same names as epdserve:*, per worker and stage), or both (default); "
                             "epdserve's own metrics (KV transfer, worker_up, ...) are epdserve:* always")
