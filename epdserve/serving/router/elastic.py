"""The elastic controller (``serve --elastic``) and the workforce that adds and retires
workers; its trace lines replay in :mod:`epdserve.plan.elastic_replay` (docs/elastic.md)."""

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


POLL_S = 0.25


class ScaleRefused(Exception):
    """``status``: 400 a bad role, 404 no such live worker, 409 at a bound or already retiring,
    503 the cluster could not start one."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class Scaler(Protocol):
    def add(self, role: str) -> str:
        """Returns at once (it says Hello when up). Raises RuntimeError: none can be started."""

    def remove(self, worker_id: str) -> None:
        """For good, freeing what it holds on the cluster; never raises."""


class Periodic:
    """A :meth:`step` every ``period_s`` seconds; a failed step is logged, never fatal."""

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
    """Why ``worker_id`` may not stop decoding now, or None: decode never returns to the worker
    that prefilled, so each holder of un-handed-off KV needs another decoder."""
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
    """Keeps the engine workers within ``[min_workers, max_workers]``; ``scaler`` None: none can be added."""

    def __init__(self, registry: Registry, scaler: Scaler | None, min_workers: int, max_workers: int,
                 startup_timeout_s: float, write: Callable[[dict], None], clock: Callable[[], float] = time.monotonic):
        self.registry, self.scaler, self.write, self.clock = registry, scaler, write, clock
        self.min_workers, self.max_workers, self.startup_timeout_s = min_workers, max_workers, startup_timeout_s
        self.starting: dict[str, tuple[str, float]] = {}  # id -> (role, when asked)
        self.retiring: dict[str, float | None] = {}  # id -> stats_seen when first found holding no request
        self.period_s = POLL_S

    def live(self) -> list[str]:
        """Not retiring."""
        return [w.worker_id for w in self.registry.workers.values()
                if self.registry.live(w) and not w.retiring and w.role in ENGINE_ROLES]

    def changing(self) -> int:
        return len(self.starting) + len(self.retiring)

    def add(self, role: str, reason: str) -> str:
        """Raises ScaleRefused: not an engine role (400), ``max_workers`` reached counting those
        starting (409), the scaler failed (503)."""
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
        """Removed once it holds nothing. Raises ScaleRefused: no such live worker (404); already
        retiring, at ``min_workers``, or :func:`strands_decodes` (409)."""
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
        # a worker's messages arrive in order: a Stats sent after its last request counts every
        # block still held (exported KV included)
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
    """Every ``interval_s`` seconds; with a ``workforce`` and ``scaling``, scales when the role policy holds."""

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
        """``POST /roles``: the dwell restarts, so the next decision does not undo it at once."""
        self._restart_dwell(self.clock(), what)

    def _restart_dwell(self, t: float, cause: str) -> None:
        """``t``: the controller's clock (s); the ``elastic_dwell`` line lets a replay restart it too."""
        self.state = PolicyState(last_switch_t=t)
        self.write({"event": "elastic_dwell", "at": time.time(), "t": t, "cause": cause})

    def sample(self) -> Sample:
        """Request events since the last sample."""
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
        # the role policy's window may reach further back at low rates
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
