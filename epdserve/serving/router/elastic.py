"""The elastic controller (``serve --elastic``): every ``--elastic-interval`` seconds it
samples the signals the router has, asks the policy
(:func:`~epdserve.serving.elastic_policy.decide`, a pure function of the samples of the
last ``--elastic-window`` seconds) for the workers' roles, and switches the workers whose
role differs (:meth:`Registry.set_role`). Every sample and every decision that changes
roles goes to the trace file (``elastic_sample``, ``elastic_decision`` lines; the policy
can be replayed from them, :mod:`epdserve.plan.elastic_replay`), and each decision to the
log with the numbers that caused it (docs/elastic.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable

from epdserve.serving.elastic_policy import Decision, PolicyConfig, PolicyState, Sample, WorkerSignal, decide, window
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.serving.router.registry import Registry
from epdserve.serving.router.signals import SignalRecorder

log = logging.getLogger("epdserve.router")


class Controller:
    """Samples ``registry`` and ``signals`` every ``interval_s`` seconds (``clock``:
    monotonic seconds) and applies the policy's decisions; ``write`` gets each trace line."""

    def __init__(self, registry: Registry, signals: SignalRecorder, config: PolicyConfig, interval_s: float,
                 write: Callable[[dict], None], clock: Callable[[], float] = time.monotonic):
        self.registry, self.signals, self.config = registry, signals, config
        self.interval_s, self.write, self.clock = interval_s, write, clock
        self.samples: deque[Sample] = deque()
        self.state = PolicyState()
        self.task: asyncio.Task | None = None

    def sample(self) -> Sample:
        """The signals now: the live engine workers' numbers and the request events since
        the last sample."""
        workers = tuple(WorkerSignal(worker_id=w.worker_id, role=w.role, switching=w.switch_id is not None,
                                     num_running=w.num_running, num_waiting=w.num_waiting,
                                     outstanding=len(w.outstanding),
                                     kv_usage=w.blocks_in_use / w.blocks_total if w.blocks_total else 0.0)
                        for w in self.registry.workers.values()
                        if self.registry.live(w) and w.role in ENGINE_ROLES)
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

    async def run(self) -> None:
        """Tick every ``interval_s`` seconds until cancelled; a failing tick is logged, not fatal."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # the controller must never take the router down
                log.exception("elastic: controller tick failed")

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
