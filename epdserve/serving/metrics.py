"""Prometheus metrics of the router, in a registry of its own (not the global default),
so that several routers can live in one process (tests).

Two views of the same measurements, chosen by ``--metrics-prefix`` (:data:`METRICS_PREFIXES`):

* ``vllm:`` — the deployment seen as one vLLM server: vLLM V1's names, meanings, labels
  and buckets (``vllm/v1/metrics/loggers.py``, ``docs/design/metrics.md``), so that vLLM's
  Grafana dashboard and gateway scrapers (llm-d, the Gateway API inference extension) work
  unmodified. Scheduler gauges are one series per deployment (a scraper takes one series
  per endpoint): running and waiting requests summed over the live workers, KV-cache usage
  as blocks in use over blocks of the live workers that hold KV. Counters of the workers
  (preemptions, prefix-cache and embedding-cache tokens/images) are summed.
* ``epdserve:`` — the same names per worker (labels ``worker``, ``role``) and per stage
  (``stage``, ``role``), plus epdserve's own metrics that vLLM has no name for
  (``worker_up``, KV blocks, KV transfer time and bytes, failed and bad requests), which
  are always exported, whatever the prefix.

Every series carries ``model_name``, the served model name, and ``engine``, as vLLM's do
(vLLM's engine is its engine core's index, "0" for one engine): on a per-worker series (one
with a ``worker`` label) the worker's id, the same value as ``worker``; on every series the
router computes or sums over workers (all of ``vllm:``, the per-request and per-stage
histograms, the KV transfer, failure and routing counters, the worker-state gauges)
:data:`ROUTER_ENGINE`. Times are in seconds, sizes in bytes. The per-request histograms are
observed from the request's trace record (:meth:`~epdserve.serving.router.flows.Flow.trace`)
when it ends, so that /metrics and ``--trace-file`` agree.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.trace import RequestTrace

METRICS_PREFIXES = ("both", "vllm", "epdserve")
DEFAULT_METRICS_PREFIX = "both"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's request_latency_buckets: e2e, queue, prefill, decode and inference time.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's buckets for inter-token latency and per-request time per output token.
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 5.0, 10.0)
KV_BYTES_BUCKETS = tuple(float(4 ** k * 1024) for k in range(0, 12))  # 1 KiB .. 4 GiB
# A role switch's drain: ~0.5 ms with nothing held, seconds for a long decode (docs/elastic.md).
DRAIN_BUCKETS = (0.001, 0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# The worker role that prefills / decodes a request, by its trace record's ``path``.
PREFILL_ROLE = {"colocated": "colocated", "disaggregated": "prefill", "local": "decode"}
DECODE_ROLE = {"colocated": "colocated", "disaggregated": "decode", "local": "decode"}
# Worker totals that become counters, in the order :meth:`RouterMetrics.set_worker` keeps them.
WORKER_TOTALS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "mm_cache_queries",
                 "mm_cache_hits")
# Requests of n > 1 choices whose choices have not all ended, at most (the oldest is dropped
# past it: a choice never ended is a leak elsewhere, which must not grow this too).
MAX_OPEN_PARALLEL = 65536
# The finished_reason values of request_success: vLLM's FinishReason (vllm/v1/engine/__init__.py);
# abort: the client went away; error: a worker failed the request; repetition: never here.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
# The engine label of the series the router computes or sums over workers.
ROUTER_ENGINE = "router"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (inclusive): vLLM's token-count
    buckets (``build_1_2_5_buckets`` of ``vllm/v1/metrics/loggers.py``), at least ``(1,)``."""
    out, scale = [], 1
    while True:  # bounded: scale grows tenfold each pass until it passes max_value
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out) or (1,)
            out.append(m * scale)
        scale *= 10


class _Series:
    """One metric in ``metrics``' registry whose series carry ``model_name`` and ``engine``
    before its own ``labels``; :meth:`labels` and :meth:`remove` take the values of its own
    labels only. ``engine`` is the value of its ``worker`` label where it has one (a
    per-worker series), else :data:`ROUTER_ENGINE`."""

    def __init__(self, metrics: RouterMetrics, cls, name: str, doc: str, labels=(), **kw):
        self.metric = cls(name, doc, ["model_name", "engine", *labels], registry=metrics.registry, **kw)
        self.model = metrics.model_name
        self.worker = list(labels).index("worker") if "worker" in labels else None

    def _values(self, values: tuple) -> tuple:
        return (self.model, ROUTER_ENGINE if self.worker is None else values[self.worker], *values)

    def labels(self, *values):
        """The series of these label values (created at 0 the first time)."""
        return self.metric.labels(*self._values(values))

    def remove(self, *values) -> None:
        """Drop the series of these label values from the exposition."""
        self.metric.remove(*self._values(values))


class _Named:
    """One vLLM-named metric under each prefix enabled: ``vllm:NAME`` (labels
    ``model_name``, ``engine`` + ``vllm_labels``) and ``epdserve:NAME`` (``model_name``,
    ``engine`` + ``epd_labels``), each a :class:`_Series`."""

    def __init__(self, metrics: RouterMetrics, cls, name: str, doc: str, vllm_labels=(), epd_labels=(), **kw):
        def make(prefix: str, labels) -> _Series | None:
            if prefix not in metrics.prefixes:
                return None
            return _Series(metrics, cls, f"{prefix}:{name}", doc, labels, **kw)

        self.vllm = make("vllm", vllm_labels)
        self.epd = make("epdserve", epd_labels)
        # Series without other labels exist from the start (at 0), as vLLM's: a dashboard
        # or scraper finds every name before the first request.
        for metric, labels in ((self.vllm, vllm_labels), (self.epd, epd_labels)):
            if metric is not None and not labels:
                metric.labels()

    def children(self, vllm: tuple = (), epd: tuple = (), views: str = "both") -> list:
        """The labelled series to update: the vllm one with ``vllm`` label values, the
        epdserve one with ``epd``; ``views`` "vllm" or "epdserve" picks one."""
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
    """All router metrics; :meth:`render` gives the Prometheus text exposition.

    ``model_name``: the served model name (the ``model_name`` label, as vLLM's
    ``--served-model-name``); ``prefix``: one of :data:`METRICS_PREFIXES` (``both``: the
    vLLM-named metrics under ``vllm:`` and ``epdserve:``); ``max_model_len`` (tokens): the
    top of the token-count buckets, as vLLM sizes them.

    Raises:
        ValueError: ``prefix`` is not one of :data:`METRICS_PREFIXES`.
    """

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
        for reason in FINISHED_REASONS:  # vLLM creates a series per finish reason up front
            self.request_success.children(vllm=(reason,), epd=(reason,))
        self._set_deployment_gauges()

    def _own_metrics(self) -> None:
        """epdserve's metrics without a vLLM name, always under ``epdserve:``."""
        def series(cls, name: str, doc: str, labels=(), **kw) -> _Series:
            return _Series(self, cls, f"epdserve:{name}", doc, labels, **kw)

        wl = ("worker", "role")
        self._worker_up = series(Gauge, "worker_up", "1 if the worker is up, 0 if down or refused.", wl)
        # Where each worker runs, as an info series (kube-state-metrics' *_info convention):
        # join it on ``worker`` to split any per-worker series by node; the per-worker series
        # keep their labels, so dashboards and scrapers built on them are unchanged.
        self._worker_node = series(Gauge, "worker_node_info", "1 per worker and the node it runs on "
                                   "(Ray node id or host name, and its IP).", (*wl, "node", "node_ip"))
        self._nodes: dict[tuple[str, str], tuple[str, str]] = {}  # (worker, role) -> its (node, node_ip)
        # Elastic: each worker's routing role (1) among the engine roles (0), its switches and drains.
        self._worker_role = series(Gauge, "worker_role", "1 for the role the router routes to the worker by, "
                                   "0 for the other engine roles.", wl)
        self._roles: dict[str, str] = {}  # worker -> its role now
        self.role_switches = series(Counter, "role_switches", "Role switches a worker announced (elastic).",
                                    ("worker", "from_role", "to_role"))
        self.role_switch_drain = series(Histogram, "role_switch_drain_seconds", "From a worker's receipt of a "
                                        "role switch to its announcement: the time its old role's work took to "
                                        "finish.", buckets=DRAIN_BUCKETS).labels()
        # Elastic scaling (--max-workers): the engine workers by state, and the scale decisions.
        self._worker_states = series(Gauge, "workers", "Engine workers by state (elastic: live, starting, "
                                     "retiring).", ("state",))
        self._scale = series(Counter, "worker_scale", "Workers added (out) or retired (in), by the elastic "
                             "controller or by hand.", ("direction",))
        self.kv_blocks_in_use = series(Gauge, "kv_blocks_in_use", "KV cache blocks in use.", wl)
        self.kv_blocks_total = series(Gauge, "kv_blocks_total", "KV cache blocks in the pool.", wl)
        self.request_failure = series(Counter, "request_failure_total", "Requests that failed after admission "
                                      "(worker error, timeout, no worker).").labels()
        self.bad_request = series(Counter, "bad_request_total", "Requests answered with HTTP 400.").labels()
        # Labels: policy (--routing); hit: the first worker found some of the prompt in its
        # prefix cache; believed: the router expected it to ("none": least-loaded keeps no belief).
        self.routed = series(Counter, "routed_requests_total", "Requests routed to their first worker, by routing "
                             "policy, whether the worker's prefix cache hit, and whether the router believed it "
                             "would.", ("policy", "hit", "believed"))
        self.kv_transfer_seconds = series(Histogram, "kv_transfer_seconds", "KV export + router hop + KV import, "
                                          "per PD request.", buckets=KV_SECONDS_BUCKETS).labels()
        self.kv_transfer_bytes = series(Histogram, "kv_transfer_bytes", "KV cache bytes per PD request.",
                                        buckets=KV_BYTES_BUCKETS).labels()

    def _worker_metrics(self) -> None:
        """vLLM's scheduler gauges and counters: per worker under ``epdserve:``, for the
        deployment under ``vllm:``."""
        wl = ("worker", "role")
        self.num_requests_running = _Named(self, Gauge, "num_requests_running",
                                           "Requests in model execution batches.", epd_labels=wl)
        self.num_requests_waiting = _Named(self, Gauge, "num_requests_waiting",
                                           "Requests waiting to be processed.", epd_labels=wl)
        # vLLM V1's kv_cache_usage_perc: a fraction, 1 = every block in use.
        self.kv_cache_usage = _Named(self, Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                     epd_labels=wl)
        # vLLM's name before 0.10 (still read by older gateways and dashboards); vllm: only.
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
        # vLLM exports LoRA state only with LoRA on; epdserve serves no adapters, and says so
        # to gateways that read it (their LoRA affinity then has nothing to prefer).
        self.lora_info = _Series(self, Gauge, "vllm:lora_requests_info", "Running stats on lora requests.",
                                 ("max_lora", "running_lora_adapters", "waiting_lora_adapters")) \
            if "vllm" in self.prefixes else None

    def _request_metrics(self) -> None:
        """The per-request counters and timing histograms."""
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
        """vLLM's request-level token and parameter histograms."""
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

    # -- workers
    def set_worker_up(self, worker: str, role: str, up: bool) -> None:
        """Mark a worker up (after its Hello) or down (dead, refused, replaced); a down
        worker leaves the deployment's ``vllm:`` gauges."""
        self._worker_up.labels(worker, role).set(1 if up else 0)
        if not up and self._workers.pop((worker, role), None) is not None:
            self._set_deployment_gauges()

    def set_role(self, worker: str, role: str) -> None:
        """``worker`` is routed as ``role`` from now (its Hello, or a switch):
        ``epdserve:worker_role`` is 1 for it and 0 for the other engine roles, and the
        totals its Stats report carry on under the new role's series."""
        previous = self._roles.get(worker)
        if previous is not None and previous != role:
            self._leave_role(worker, previous, role)
        self._roles[worker] = role
        for r in dict.fromkeys((*ENGINE_ROLES, role)):  # an encode worker's too
            self._worker_role.labels(worker, r).set(1 if r == role else 0)

    def _leave_role(self, worker: str, previous: str, role: str) -> None:
        """``worker``'s per-worker series move from ``previous`` to ``role``: its gauges under
        ``previous`` go (their last values would read as blocks and requests held forever;
        the next Stats sets them under ``role``), its node info and the totals its counters
        count from carry over. Counters stay under ``previous``: what it did in that role."""
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
        """``epdserve:workers{state}``: how many engine workers are live (taking work),
        starting (added, not up yet) and retiring (finishing what they hold)."""
        for state, n in (("live", live), ("starting", starting), ("retiring", retiring)):
            self._worker_states.labels(state).set(n)

    def scaled(self, direction: str) -> None:
        """Count one worker added (``direction`` "out") or retired ("in")."""
        self._scale.labels(direction).inc()

    def role_switched(self, worker: str, previous: str, role: str, drain_s: float) -> None:
        """``worker`` announced its switch from ``previous`` to ``role`` after draining ``drain_s`` seconds."""
        self.role_switches.labels(worker, previous, role).inc()
        self.role_switch_drain.observe(drain_s)

    def set_worker_node(self, worker: str, role: str, node: str, node_ip: str) -> None:
        """Record where ``worker`` runs (from its Hello): ``epdserve:worker_node_info`` is 1
        for its current node and the series of a node it left is removed."""
        old = self._nodes.get((worker, role))
        if old is not None and old != (node, node_ip):
            self._worker_node.remove(worker, role, *old)
        self._nodes[(worker, role)] = (node, node_ip)
        self._worker_node.labels(worker, role, node, node_ip).set(1)

    def set_worker(self, worker: str, role: str, *, blocks_in_use: int, blocks_total: int,
                   num_running: int, num_waiting: int, num_preemptions: int = 0,
                   prefix_cache_queries: int = 0, prefix_cache_hits: int = 0, mm_cache_queries: int = 0,
                   mm_cache_hits: int = 0, num_steps: int = 0, last_step_tokens: int = 0) -> None:
        """Update one worker's gauges and counters from its Stats, whose preemption,
        prefix-cache and embedding-cache numbers are the worker's totals since it started
        (a worker that restarted reports smaller totals: its counters go on from the new totals).
        A new ``num_steps`` (the worker's forward passes) observes ``last_step_tokens``, the
        tokens of its latest step, in vLLM's ``iteration_tokens_total``."""
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
        """The ``vllm:`` scheduler gauges: sums over the live workers, KV usage over those
        that hold KV (encode workers have no blocks), and the LoRA info's timestamp."""
        if "vllm" not in self.prefixes:
            return
        live = self._workers.values()
        self.num_requests_running.set(sum(w["num_running"] for w in live), views="vllm")
        self.num_requests_waiting.set(sum(w["num_waiting"] for w in live), views="vllm")
        total = sum(w["blocks_total"] for w in live)
        usage = sum(w["blocks_in_use"] for w in live) / total if total else 0.0
        self.kv_cache_usage.set(usage, views="vllm")
        self.gpu_cache_usage.labels().set(usage)
        # As vLLM: the value is when the state was last recorded (gateways take the newest).
        self.lora_info.labels("0", "", "").set(time.time())

    # -- requests
    def admitted(self, request_id: str, n: int) -> None:
        """A request of ``n`` choices (engine requests ``<request_id>-<i>`` when n > 1) was
        admitted; once all have ended, its n and most generated tokens are observed (vLLM's
        ``request_params_n`` and ``request_max_num_generation_tokens``, per parent request)."""
        if n > 1:
            self._parallel[request_id] = [n, n, 0]
            if len(self._parallel) > MAX_OPEN_PARALLEL:
                del self._parallel[next(iter(self._parallel))]

    def ended(self, rec: RequestTrace, itls_s: list[float] | None) -> None:
        """Record one engine request that ended: finished (``itls_s``, the gaps between its
        outputs reaching the router, in seconds) or failed (``itls_s`` None: counted in
        ``epdserve:request_failure_total`` and, as vLLM, in ``request_success_total`` with
        ``finished_reason="error"``). A request its first worker answered counts in
        ``epdserve:routed_requests_total``."""
        if rec.routing is not None and rec.cached_tokens is not None:
            believed = "none" if rec.routing_believed_tokens is None else str(rec.routing_believed_tokens > 0).lower()
            self.routed.labels(rec.routing, str(rec.cached_tokens > 0).lower(), believed).inc()
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
        """Record one request that ended without an error.

        ``rec``: its trace record (ms; see :mod:`epdserve.trace`); ``itls_s``: the gaps
        between its outputs (one token each) reaching the router, in seconds. TPOT is
        their mean, as vLLM's (decode time / (output tokens - 1)).
        """
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
        if rec.kv_transfer_ms:  # a hand-off happened (colocated records carry 0)
            self.kv_transfer_seconds.observe(rec.kv_transfer_ms / 1000)
            self.kv_transfer_bytes.observe(rec.kv_bytes)

    def _stage_times(self, rec: RequestTrace) -> None:
        """Queue, prefill, decode and inference time: under ``vllm:`` the request's worker
        queues (vLLM's engine queue) and times, under ``epdserve:`` by stage / role."""
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
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def add_metrics_options(parser) -> None:
    """``--metrics-prefix``, for ``epdserve router`` and ``epdserve serve``."""
    parser.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default=DEFAULT_METRICS_PREFIX,
                        help="names on /metrics: vllm (vLLM's vllm:* names, labels and meanings, the deployment "
                             "as one server: vLLM's Grafana dashboard and gateway scrapers read them), epdserve "
                             "(the same names as epdserve:*, per worker and stage), or both (default); "
                             "epdserve's own metrics (KV transfer, worker_up, ...) are epdserve:* always")
