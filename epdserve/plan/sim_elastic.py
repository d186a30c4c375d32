"""Elastic deployments in the simulator (``serve --elastic``): workers that switch role live, and
the controller in the loop calling the live policy (imported, not copied) on samples built as
the router builds them; docs/planner.md, "Elastic deployments"."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.bench.metrics import DEFAULT_SLOS_MS
from epdserve.plan.sim_worker import Seq, Worker
from epdserve.serving.deployment import ELASTIC_SLO_KEYS
from epdserve.serving.elastic.policy import Decision, PolicyConfig, PolicyState, Sample, decide, window
from epdserve.serving.elastic.samples import WorkerSignal
from epdserve.serving.deployment import ELASTIC_INTERVAL_S, ELASTIC_MIN_DWELL_S, ELASTIC_WINDOW_S

if TYPE_CHECKING:  # simulate imports this module
    from epdserve.plan.simulate import Simulation


@dataclass(frozen=True)
class ElasticConfig:
    """Raises ValueError for an ``interval_s`` not finite and > 0: the simulated controller
    must tick (serve's 0 is a static deployment here)."""
    policy: PolicyConfig
    interval_s: float = ELASTIC_INTERVAL_S

    def __post_init__(self):
        if not 0 < self.interval_s < float("inf"):
            raise ValueError(f"elastic interval {self.interval_s!r}: expected a number of seconds > 0")


def elastic_config(slos_ms: dict[str, float], window_s: float = ELASTIC_WINDOW_S, min_dwell_s: float = ELASTIC_MIN_DWELL_S,
                   interval_s: float = ELASTIC_INTERVAL_S) -> ElasticConfig:
    """The controller ``serve --elastic`` runs with these flags; a missing ``ttft`` or ``tpot``
    (ms) takes compare's default. Raises ValueError naming the value."""
    slos = {**{k: DEFAULT_SLOS_MS[k] for k in ELASTIC_SLO_KEYS}, **slos_ms}
    return ElasticConfig(PolicyConfig(slo_ttft_ms=slos["ttft"], slo_tpot_ms=slos["tpot"], window_s=window_s,
                                      min_dwell_s=min_dwell_s), interval_s)


class ElasticWorker(Worker):
    """``worker_id`` as serve names them (``worker-0``, ... in placement order)."""

    def __init__(self, sim: Simulation, *args):
        super().__init__(sim, *args)
        self.worker_id = f"worker-{len(sim.workers)}"
        self.holding: dict[int, str] = {}  # request index -> the role it was taken in
        self.switching_since: float | None = None
        self.previous = ""

    def submit(self, seq: Seq, role: str = "") -> None:
        super().submit(seq, role)
        self.holding[seq.index] = seq.role

    def reserve(self, s: Seq, sign: int) -> None:
        """Giving back is where a request leaves this worker, which may end a drain."""
        super().reserve(s, sign)
        if sign < 0:
            del self.holding[s.index]
            self._announce_if_drained()

    def _start_decode(self, s: Seq, k: int, context: int) -> None:
        super()._start_decode(s, k, context)
        self.sim.controller.decoding(s, self)

    def switch(self, role: str) -> None:
        """Take work as ``role`` now; what it holds drains under its old role."""
        self.previous, self.role = self.role, role
        self.switching_since = self.sim.env.now
        self.sim.controller.role_event(self, "switching")
        self._announce_if_drained()

    def _announce_if_drained(self) -> None:
        if self.switching_since is not None and all(r == self.role for r in self.holding.values()):
            drain_s = self.sim.env.now - self.switching_since
            self.switching_since = None
            self.sim.controller.role_event(self, "switched", drain_s * 1e3)

    def signal(self) -> WorkerSignal:
        """As the router's controller samples a worker; KV usage counts blocks reserved at
        admission, not those filled so far."""
        total = self.sim.platform.kv_capacity_tokens
        blocks = total(self.size) // self.sim.limits.block_size if total else 0
        return WorkerSignal(worker_id=self.worker_id, role=self.role, switching=self.switching_since is not None,
                            num_running=len(self.prefilling) + self.num_decode,
                            num_waiting=len(self.waiting) + len(self.inbox), outstanding=self.held,
                            kv_usage=(blocks - self.free_blocks) / blocks if blocks else 0.0)


class Controller:
    """``decisions``: every decision (holds included); ``events``: role events as the router's
    trace writes them (``t`` in simulated s)."""

    def __init__(self, sim: Simulation, config: ElasticConfig):
        self.sim, self.config = sim, config
        self.samples: deque[Sample] = deque()
        self.state = PolicyState()
        self.decisions: list[Decision] = []
        self.events: list[dict] = [{"t": 0.0, "worker": w.worker_id, "role": w.role, "previous": None,
                                    "state": "up", "drain_ms": None, "reason": ""} for w in sim.workers]
        self._reason = ""
        # Signals since the last sample (serving/router/signals.py's SignalRecorder).
        self.arrivals: list[tuple[int, int]] = []
        self.live: dict[int, Seq] = {}            # arrived, tokens not all counted yet
        self.counted: dict[int, int] = {}
        self.decoding_on: dict[int, Worker] = {}
        self.done: set[int] = set()
        sim.env.process(self.run())

    def path(self) -> str:
        """``pd`` with a prefill worker and a decode or colocated one, else ``colocated``
        (``serving_path``); ValueError with only decode workers."""
        roles = {w.role for w in self.sim.workers}
        if "prefill" in roles and roles & {"decode", "colocated"}:
            return "pd"
        if "colocated" in roles:
            return "colocated"
        raise ValueError(f"elastic roles {sorted(roles)}: no prefill-capable worker")

    def arrival(self, s: Seq) -> None:
        # The router counts the chat-templated prompt's ids, as the simulated prompt is.
        self.arrivals.append((s.prompt, s.req.max_tokens))
        self.live[s.index] = s
        self.counted[s.index] = 0

    def decoding(self, s: Seq, worker: Worker) -> None:
        self.decoding_on[s.index] = worker

    def finished(self, s: Seq) -> None:
        self.decoding_on.pop(s.index, None)
        self.done.add(s.index)

    def _token_events(self) -> tuple[list[float], list[float], list[float], list[int]]:
        """(TTFTs, prefill queue times, computed prompt tokens less the template's cached
        blocks, ITL gaps) in ms since the last call; tokens reach the "router" when their step ends."""
        ttfts, queues, itls, computed = [], [], [], []
        for index, s in list(self.live.items()):
            w = self.decoding_on.get(index)
            times = s.tokens + w.step_times[s.first_step:] if w else s.tokens
            for j in range(self.counted[index], len(times)):
                if j == 0:
                    ttfts.append((times[0] - s.arrival) * 1e3)
                    first = "colocated" if s.path == "colocated" else "prefill"
                    queues.append(self.sim.platform.router_ms + s.stages.get(f"{first}_queue_ms", 0.0))
                    computed.append(max(s.prompt - self.sim.cached_prefix, 1))
                else:
                    itls.append((times[j] - times[j - 1]) * 1e3)
            self.counted[index] = len(times)
            if index in self.done:
                del self.live[index], self.counted[index]
                self.done.discard(index)
        return ttfts, queues, itls, computed

    def sample(self) -> Sample:
        ttfts, queues, itls, computed = self._token_events()
        arrivals, self.arrivals = tuple(self.arrivals), []
        return Sample(t=self.sim.env.now, workers=tuple(w.signal() for w in self.sim.workers), arrivals=arrivals,
                      ttfts_ms=tuple(ttfts), prefill_queue_ms=tuple(queues), itls_ms=tuple(itls),
                      prefill_tokens=tuple(computed))

    def tick(self) -> Decision:
        sample = self.sample()
        self.samples.append(sample)
        kept = window(self.samples, self.config.policy)
        while len(self.samples) > len(kept):
            self.samples.popleft()
        decision, self.state = decide(kept, self.state, self.config.policy)
        self.decisions.append(decision)
        if decision.roles is not None:
            self._reason = decision.reason
            for w in self.sim.workers:
                if decision.roles.get(w.worker_id, w.role) != w.role:
                    w.switch(decision.roles[w.worker_id])
        return decision

    def run(self):
        while True:
            yield self.sim.env.timeout(self.config.interval_s)
            self.tick()

    def role_event(self, w: ElasticWorker, state: str, drain_ms: float | None = None) -> None:
        self.events.append({"t": self.sim.env.now, "worker": w.worker_id, "role": w.role, "previous": w.previous,
                            "state": state, "drain_ms": drain_ms, "reason": self._reason})

    def report(self) -> dict:
        """JSON: ``decisions`` that changed roles (``t`` in simulated s), ``role_events`` with
        ``drain_ms``, ``holds`` and ``last_hold``, and the final ``roles``."""
        holds = [d for d in self.decisions if d.roles is None]
        return {"decisions": [{"t": d.t, "action": d.action, "roles": d.roles, "reason": d.reason,
                               "signals": d.signals} for d in self.decisions if d.roles is not None],
                "role_events": [e for e in self.events if e["state"] != "up"],
                "holds": len(holds), "last_hold": holds[-1].reason if holds else None,
                "roles": {w.worker_id: w.role for w in self.sim.workers}}
