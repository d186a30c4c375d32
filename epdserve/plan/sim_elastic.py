"""Elastic deployments in the simulator (``serve --elastic``, docs/elastic.md).

A simulated engine worker changes role between colocated, prefill and decode as a live one
does ("A switch"): the router routes by its new role at once (:meth:`Simulation.pick`
reads ``Worker.role``), and the worker takes the new role's work at once while every
request it holds finishes under the role it was taken in (``Seq.role``: its drain); once
none of those is left it announces the switch, and the drain time is recorded. A request's
path is chosen by the roles live when it arrives (:meth:`Controller.path`, as the
registry's ``serving_path``); its decode stage never goes back to the worker that prefilled
it and goes to a colocated worker when no decode worker is live (``Simulation.pick``), as
``serving/router/flows.py`` does.

The controller is in the loop: every ``interval_s`` simulated seconds it builds a
:class:`~epdserve.serving.elastic.policy.Sample` from the simulated state as
``serving/router/elastic.py`` and ``serving/router/signals.py`` build one from the live
router's (arrivals with their prompt tokens and ``max_tokens``; the TTFT and prefill queue
time of each first token since the last sample; the gaps between a request's tokens; per
worker its running, waiting and outstanding requests, KV usage and whether it is
switching), calls the policy's :func:`~epdserve.serving.elastic.policy.decide` on the
window and applies the roles it returns. The policy is imported, not copied. Differences
from the live router, all of the simulator's own making: tokens reach the "router" when
their step ends (no IPC, no batching of outputs), and KV usage counts the blocks a request
reserves at admission (its prompt plus ``max_tokens``), not the blocks filled so far.
"""

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

if TYPE_CHECKING:  # for annotations only: simulate imports this module
    from epdserve.plan.simulate import Simulation



@dataclass(frozen=True)
class ElasticConfig:
    """The controller of a simulated elastic deployment: the policy's SLOs, window and
    dwell (``serve --slo ttft:MS tpot:MS --elastic-window S --elastic-min-dwell S``) and the
    sampling interval (``--elastic-interval``, s).

    Raises:
        ValueError: an interval that is not a finite number > 0 (the simulator needs a
            controller that ticks; serve's 0, no controller, is a static deployment here).
    """
    policy: PolicyConfig
    interval_s: float = ELASTIC_INTERVAL_S

    def __post_init__(self):
        if not 0 < self.interval_s < float("inf"):
            raise ValueError(f"elastic interval {self.interval_s!r}: expected a number of seconds > 0")


def elastic_config(slos_ms: dict[str, float], window_s: float = ELASTIC_WINDOW_S, min_dwell_s: float = ELASTIC_MIN_DWELL_S,
                   interval_s: float = ELASTIC_INTERVAL_S) -> ElasticConfig:
    """The controller ``serve --elastic`` runs with these flags: the policy steers by the
    ``ttft`` and ``tpot`` of ``slos_ms`` (ms; serve's ``--slo`` default, compare's default
    SLOs, for a missing one), over ``window_s``, with ``min_dwell_s``, every ``interval_s``.

    Raises:
        ValueError: as :class:`PolicyConfig` and :class:`ElasticConfig`, naming the value.
    """
    slos = {**{k: DEFAULT_SLOS_MS[k] for k in ELASTIC_SLO_KEYS}, **slos_ms}
    return ElasticConfig(PolicyConfig(slo_ttft_ms=slos["ttft"], slo_tpot_ms=slos["tpot"], window_s=window_s,
                                      min_dwell_s=min_dwell_s), interval_s)


class ElasticWorker(Worker):
    """A simulated worker that can switch role; ``worker_id`` as serve names them
    (``worker-0``, ``worker-1``, ... in placement order)."""

    def __init__(self, sim: Simulation, *args):
        super().__init__(sim, *args)
        self.worker_id = f"worker-{len(sim.workers)}"
        self.holding: dict[int, str] = {}  # request index -> the role it was taken in, until released
        self.switching_since: float | None = None  # when a switch was asked, until it is announced
        self.previous = ""  # the role before the last switch

    def submit(self, seq: Seq, role: str = "") -> None:
        super().submit(seq, role)
        self.holding[seq.index] = seq.role

    def reserve(self, s: Seq, sign: int) -> None:
        """As :meth:`Worker.reserve`; giving back is where a request leaves this worker
        (finished, or its exported KV taken by the decode worker), which may end a drain."""
        super().reserve(s, sign)
        if sign < 0:
            del self.holding[s.index]
            self._announce_if_drained()

    def _start_decode(self, s: Seq, k: int, context: int) -> None:
        super()._start_decode(s, k, context)
        self.sim.controller.decoding(s, self)

    def switch(self, role: str) -> None:
        """Route and take work as ``role`` from now on; what it holds drains under its old role."""
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
        """This worker as the router's controller samples it (``serving/router/elastic.py``)."""
        total = self.sim.platform.kv_capacity_tokens
        blocks = total(self.size) // self.sim.limits.block_size if total else 0
        return WorkerSignal(worker_id=self.worker_id, role=self.role, switching=self.switching_since is not None,
                            num_running=len(self.prefilling) + self.num_decode,
                            num_waiting=len(self.waiting) + len(self.inbox), outstanding=self.held,
                            kv_usage=(blocks - self.free_blocks) / blocks if blocks else 0.0)


class Controller:
    """``serve --elastic``'s controller on the simulation's clock (see the module doc).
    ``decisions``: every decision (holds included); ``events``: the role events, as the
    router's trace writes them (``t`` in simulated s)."""

    def __init__(self, sim: Simulation, config: ElasticConfig):
        self.sim, self.config = sim, config
        self.samples: deque[Sample] = deque()
        self.state = PolicyState()
        self.decisions: list[Decision] = []
        self.events: list[dict] = [{"t": 0.0, "worker": w.worker_id, "role": w.role, "previous": None,
                                    "state": "up", "drain_ms": None, "reason": ""} for w in sim.workers]
        self._reason = ""
        # The signals since the last sample (serving/router/signals.py's SignalRecorder).
        self.arrivals: list[tuple[int, int]] = []
        self.live: dict[int, Seq] = {}            # arrived, tokens not all counted yet
        self.counted: dict[int, int] = {}         # tokens of each counted so far
        self.decoding_on: dict[int, Worker] = {}  # decoding now, and where
        self.done: set[int] = set()
        sim.env.process(self.run())

    def path(self) -> str:
        """The path a request arriving now takes (the registry's ``serving_path``): ``pd``
        with a prefill worker and a decode or colocated one, else ``colocated``.

        Raises:
            ValueError: only decode workers are live (serve's "local" path, which no
                decision of the policy leads to).
        """
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
        """The TTFTs, prefill queue times and computed prompt tokens (less the template's
        cached blocks, the prefix-cache hit of nearly every prompt) of first tokens, and the
        gaps between tokens, that came since the last call (ms). A decoding request's tokens so far are its
        worker's step ends since it joined (``Worker._finish_step`` records them at the end)."""
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
        """The signals now, as ``serving/router/elastic.py``'s ``Controller.sample``."""
        ttfts, queues, itls, computed = self._token_events()
        arrivals, self.arrivals = tuple(self.arrivals), []
        return Sample(t=self.sim.env.now, workers=tuple(w.signal() for w in self.sim.workers), arrivals=arrivals,
                      ttfts_ms=tuple(ttfts), prefill_queue_ms=tuple(queues), itls_ms=tuple(itls),
                      prefill_tokens=tuple(computed))

    def tick(self) -> Decision:
        """Sample, decide on the window, apply (``serving/router/elastic.py``'s ``tick``)."""
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
        """Record a switch of ``w`` asked (``switching``) or announced (``switched``, after
        ``drain_ms``), with the reason of the decision that asked it."""
        self.events.append({"t": self.sim.env.now, "worker": w.worker_id, "role": w.role, "previous": w.previous,
                            "state": state, "drain_ms": drain_ms, "reason": self._reason})

    def report(self) -> dict:
        """What the controller did (JSON): ``decisions`` that changed roles (``t`` in
        simulated s, ``action``, ``roles``, ``reason``, ``signals``), ``role_events`` (each
        switch asked and announced, with ``drain_ms``), the number of ``holds`` and the last
        hold's reason, and the ``roles`` each worker had at the end."""
        holds = [d for d in self.decisions if d.roles is None]
        return {"decisions": [{"t": d.t, "action": d.action, "roles": d.roles, "reason": d.reason,
                               "signals": d.signals} for d in self.decisions if d.roles is not None],
                "role_events": [e for e in self.events if e["state"] != "up"],
                "holds": len(holds), "last_hold": holds[-1].reason if holds else None,
                "roles": {w.worker_id: w.role for w in self.sim.workers}}
