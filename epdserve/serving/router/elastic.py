"""The elastic controller (``serve --elastic``): every ``--elastic-interval`` seconds it
samples the signals the router has, asks the policy
(:func:`~epdserve.serving.elastic.policy.decide`, a pure function of the samples of the
last ``--elastic-window`` seconds) for the workers' roles, and switches the workers whose
role differs (:meth:`Registry.set_role`). Every sample and every decision that changes
roles goes to the trace file (``elastic_sample``, ``elastic_decision`` lines; the policy
can be replayed from them, :mod:`epdserve.plan.elastic_replay`), and each decision to the
log with the numbers that caused it (docs/elastic.md).

With ``--max-workers`` above the starting count the controller also adds and retires
workers (:func:`~epdserve.serving.elastic.scaling.decide_scale`, asked when the role policy
holds) through a :class:`Workforce`, which ``POST /workers`` and ``DELETE /workers/{id}``
use too; the launcher passes it a :class:`Scaler` (Ray's actors) to start and stop them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Protocol

from epdserve.serving.elastic.policy import Decision, PolicyConfig, PolicyState, Sample, decide, window
from epdserve.serving.elastic.scaling import ScaleDecision, ScalingConfig, ScalingState, decide_scale
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.serving.router.registry import Registry
from epdserve.serving.router.signals import SignalRecorder
from epdserve.serving.elastic.samples import WorkerSignal

log = logging.getLogger("epdserve.router")


POLL_S = 0.25  # how often the workforce looks at its starting and retiring workers


class ScaleRefused(Exception):
    """A worker cannot be added or retired now; ``status``: the HTTP status that says why
    (400 a bad role, 404 no such live worker, 409 at a bound or already retiring, 503 the
    cluster could not start one)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Scaler(Protocol):
    """How the workforce starts and stops workers (the launcher's: Ray actors)."""

    def add(self, role: str) -> str:
        """Start a new worker of ``role`` (in the background: it says Hello when up); its id.

        Raises:
            RuntimeError: no worker can be started (the message says why).
        """

    def remove(self, worker_id: str) -> None:
        """Stop ``worker_id`` for good (after it was told to shut down) and free what it
        holds on the cluster; never raises."""


class Periodic:
    """A :meth:`step` every ``period_s`` seconds in the router's event loop, from
    :meth:`start` until :meth:`stop`; a step that fails is logged, never fatal (it must not
    take the router down)."""

    period_s: float
    task: asyncio.Task | None = None

    def step(self) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.step()
            except Exception:
                log.exception("elastic: %s step failed", type(self).__name__)

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def strands_decodes(registry: Registry, worker_id: str) -> str | None:
    """Why ``worker_id`` may not stop decoding now (switch to prefill, retire), or None.
    Prefill workers alone serve nothing, and the decode stage never returns to the worker
    that prefilled: so another live worker must decode, and one besides each worker whose
    prefills' KV has yet to be handed off (a prefill worker, or one that switched from
    prefill and drains)."""
    def decoder_besides(*ids: str) -> bool:
        return any(w.worker_id not in ids and registry.live(w) and not w.retiring
                   and w.role in ("colocated", "decode") for w in registry.workers.values())

    if not decoder_besides(worker_id):
        return f"worker {worker_id} is the last live worker that can decode"
    for p in registry.workers.values():
        if p.worker_id != worker_id and registry.live(p) and p.exports and not decoder_besides(worker_id, p.worker_id):
            return (f"worker {p.worker_id} holds {len(p.exports)} prefill(s) whose KV only worker {worker_id} "
                    "could decode: try again once they are handed off")
    return None


class Workforce(Periodic):
    """The elastic engine workers' number, within ``[min_workers, max_workers]``: adds
    workers through ``scaler`` (None: none can be added) and retires them (no new work at
    once, then :meth:`Registry.remove` and ``scaler.remove`` once it holds nothing: no
    request in flight, no KV block in use, as a Stats received after its last request
    says). A worker not up within ``startup_timeout_s`` is given up. ``write`` gets the
    ``role`` trace lines of starting and given-up workers."""

    def __init__(self, registry: Registry, scaler: Scaler | None, min_workers: int, max_workers: int,
                 startup_timeout_s: float, write: Callable[[dict], None], clock: Callable[[], float] = time.monotonic):
        self.registry, self.scaler, self.write, self.clock = registry, scaler, write, clock
        self.min_workers, self.max_workers, self.startup_timeout_s = min_workers, max_workers, startup_timeout_s
        self.starting: dict[str, tuple[str, float]] = {}  # id -> (role, when asked)
        self.retiring: dict[str, float | None] = {}  # id -> stats_seen when first found holding no request
        self.period_s = POLL_S

    def live(self) -> list[str]:
        """The live engine workers that take work (not retiring)."""
        return [w.worker_id for w in self.registry.workers.values()
                if self.registry.live(w) and not w.retiring and w.role in ENGINE_ROLES]

    def changing(self) -> int:
        """Workers starting or retiring now."""
        return len(self.starting) + len(self.retiring)

    def add(self, role: str, reason: str) -> str:
        """Start a new worker of ``role``; its id.

        Raises:
            ScaleRefused: a role outside the engine roles (400), ``max_workers`` reached
                counting those starting (409), the scaler failed (503).
        """
        if role not in ENGINE_ROLES:
            raise ScaleRefused(f"role {role!r}: expected one of {', '.join(ENGINE_ROLES)}", 400)
        count = len(self.live()) + len(self.starting)
        if self.scaler is None or count >= self.max_workers:
            raise ScaleRefused(f"{count} workers live or starting: --max-workers {self.max_workers} reached", 409)
        try:
            worker_id = self.scaler.add(role)
        except RuntimeError as exc:
            raise ScaleRefused(f"cannot start a worker: {exc}", 503) from None
        self.starting[worker_id] = (role, self.clock())
        self.registry.metrics.scaled("out")
        log.info("elastic: adding worker %s (%s): %s", worker_id, role, reason)
        self._line(worker_id, role, "starting", reason)
        return worker_id

    def retire(self, worker_id: str, reason: str) -> None:
        """Stop routing to ``worker_id`` now and remove it once it holds nothing.

        Raises:
            ScaleRefused: no such live worker (404), already retiring, at ``min_workers``,
                or a worker whose decoding no other can take over (:func:`strands_decodes`) (409).
        """
        w = self.registry.workers.get(worker_id)
        if w is None or not self.registry.live(w):
            raise ScaleRefused(f"no live worker {worker_id!r}", 404)
        live = self.live()
        if w.retiring:
            raise ScaleRefused(f"worker {worker_id} is already retiring", 409)
        if len(live) <= self.min_workers:
            raise ScaleRefused(f"{len(live)} live workers: the minimum (the starting workers) is {self.min_workers}",
                               409)
        if stranded := strands_decodes(self.registry, worker_id):
            raise ScaleRefused(stranded, 409)
        self.registry.retire(worker_id, reason)
        self.retiring[worker_id] = None
        self.registry.metrics.scaled("in")

    def poll(self) -> None:
        """Admit the added workers that are up, give up those past ``startup_timeout_s``,
        remove the retiring ones that hold nothing (or died); update ``epdserve:workers``."""
        now = self.clock()
        for worker_id, (role, since) in list(self.starting.items()):
            w = self.registry.workers.get(worker_id)
            if w is not None and self.registry.live(w):
                del self.starting[worker_id]
            elif now - since > self.startup_timeout_s:
                del self.starting[worker_id]
                why = f"not up within {self.startup_timeout_s:g} s (the cluster may lack the resources): given up"
                log.error("elastic: worker %s (%s) %s", worker_id, role, why)
                self.registry.remove(worker_id, why)
                self._line(worker_id, role, "given-up", why)
                self.scaler.remove(worker_id)
        for worker_id in list(self.retiring):
            w = self.registry.workers.get(worker_id)
            if w is None or not self.registry.live(w) or not w.retiring or self._drained(w):
                del self.retiring[worker_id]
                self.registry.remove(worker_id, "retired: it holds nothing")
                if self.scaler is not None:
                    self.scaler.remove(worker_id)
        self.registry.metrics.set_worker_states(len(self.live()), len(self.starting), len(self.retiring))

    def _drained(self, w) -> bool:
        # A Stats received while it held no request came after its last request message
        # (one worker's messages arrive in order), so it counts every block still held (a
        # prefill's exported KV until the decode worker imported it).
        if w.outstanding:
            self.retiring[w.worker_id] = None
            return False
        if self.retiring[w.worker_id] is None:
            self.retiring[w.worker_id] = w.stats_seen
            return False
        return (w.stats_seen > self.retiring[w.worker_id]
                and not (w.blocks_in_use or w.num_running or w.num_waiting))

    def _line(self, worker_id: str, role: str, state: str, reason: str) -> None:
        self.write({"event": "role", "at": time.time(), "worker": worker_id, "role": role, "previous": None,
                    "state": state, "drain_ms": None, "reason": reason})

    def step(self) -> None:
        self.poll()


class Controller(Periodic):
    """Samples ``registry`` and ``signals`` every ``interval_s`` seconds (``clock``:
    monotonic seconds) and applies the policy's decisions; ``write`` gets each trace line.
    With a ``workforce`` and ``scaling`` whose bounds differ, when the role policy holds
    it asks :func:`decide_scale` too and adds or retires workers."""

    def __init__(self, registry: Registry, signals: SignalRecorder, config: PolicyConfig, interval_s: float,
                 write: Callable[[dict], None], clock: Callable[[], float] = time.monotonic):
        self.registry, self.signals, self.config = registry, signals, config
        self.interval_s, self.write, self.clock = interval_s, write, clock
        self.samples: deque[Sample] = deque()
        self.state = PolicyState()
        self.period_s = interval_s
        self.workforce: Workforce | None = None
        self.scaling: ScalingConfig | None = None
        self.scale_state = ScalingState()

    def switched_by_hand(self, what: str) -> None:
        """A role switch asked by ``POST /roles`` (``what``: which, in words): the dwell
        counts from it, as from the controller's own, so the next decision does not undo it
        at once."""
        self._restart_dwell(self.clock(), what)

    def _restart_dwell(self, t: float, cause: str) -> None:
        """Count the role policy's dwell (and its settled samples) from ``t`` (the
        controller's clock, s) for a change the policy did not decide; the ``elastic_dwell``
        trace line lets a replay restart it too (:mod:`epdserve.plan.elastic_replay`)."""
        self.state = PolicyState(last_switch_t=t)
        self.write({"event": "elastic_dwell", "at": time.time(), "t": t, "cause": cause})

    def sample(self) -> Sample:
        """The signals now: the live engine workers' numbers and the request events since
        the last sample."""
        workers = tuple(WorkerSignal(worker_id=w.worker_id, role=w.role, switching=w.switch_id is not None,
                                     num_running=w.num_running, num_waiting=w.num_waiting,
                                     outstanding=len(w.outstanding),
                                     kv_usage=w.blocks_in_use / w.blocks_total if w.blocks_total else 0.0)
                        for w in self.registry.workers.values()
                        if self.registry.live(w) and not w.retiring and w.role in ENGINE_ROLES)
        arrivals, ttfts, queues, itls, computed = self.signals.take()
        return Sample(t=self.clock(), workers=workers, arrivals=arrivals, ttfts_ms=ttfts, prefill_queue_ms=queues,
                      itls_ms=itls, prefill_tokens=computed)

    def tick(self) -> Decision:
        """Take a sample, decide on the window, apply the decision; returns it."""
        sample = self.sample()
        self.samples.append(sample)
        kept = len(window(self.samples, self.config))
        while len(self.samples) > kept:
            self.samples.popleft()
        self.write({"event": "elastic_sample", "at": time.time(), "sample": sample.as_json()})
        decision, self.state = decide(list(self.samples), self.state, self.config)
        if decision.roles is not None:
            self.apply(decision)
        elif self.workforce is not None and self.scaling is not None:
            self.scale()
        return decision

    def scale(self) -> ScaleDecision:
        """Ask the scaling policy on the window and add or retire a worker; log and trace
        every change (``elastic_decision`` with action ``scale-out`` / ``scale-in``)."""
        # The last window_s seconds: the role policy's window may reach further back at low rates.
        recent = [s for s in self.samples if s.t > self.samples[-1].t - self.scaling.window_s]
        decision, state = decide_scale(recent, self.scale_state, self.scaling,
                                       changing=self.workforce.changing(), role_change_t=self.state.last_switch_t)
        if decision.action == "hold":
            return decision
        log.info("elastic: %s: %s", decision.action, decision.reason)
        self.write({"event": "elastic_decision", "at": time.time(), "action": decision.action, "roles": None,
                    "role": decision.role, "worker": decision.worker_id, "reason": decision.reason,
                    "signals": decision.signals})
        try:
            if decision.action == "scale-out":
                self.workforce.add(decision.role, decision.reason)
            else:
                self.workforce.retire(decision.worker_id, decision.reason)
        except ScaleRefused as exc:  # the state moved since the sample: the next decision sees it
            log.warning("elastic: %s refused: %s", decision.action, exc)
            return decision
        self.scale_state = state
        self._restart_dwell(decision.t, decision.action)
        return decision

    def apply(self, decision: Decision) -> None:
        """Switch every worker whose role differs from ``decision.roles``; log and trace it."""
        log.info("elastic: %s: %s", decision.action, decision.reason)
        self.write({"event": "elastic_decision", "at": time.time(), "action": decision.action,
                    "roles": decision.roles, "reason": decision.reason, "signals": decision.signals})
        for worker_id, role in decision.roles.items():
            try:
                self.registry.set_role(worker_id, role, decision.reason)
            except (ValueError, WorkerFailed) as exc:  # gone since the sample: the next decision sees it
                log.warning("elastic: cannot switch %s to %s: %s", worker_id, role, exc)

    def step(self) -> None:
        self.tick()
