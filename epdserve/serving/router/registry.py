"""The worker registry: who is up, who holds what, who gets the next request. Joining, going
down and Reset: docs/architecture.md (Handshake; worker death); ``role`` trace lines: docs/elastic.md."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from epdserve.serving import protocol as P
from epdserve.serving.deployment import ENGINE_ROLES, MODE_ROLES, natural_order
from epdserve.serving.handshake import KV_PEER_ROLES, refusal
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.router.events import WorkerDown, WorkerFailed, event_for
from epdserve.serving.router.prefix_index import PrefixAware, PromptBlocks, load
from epdserve.serving.router.worker_state import WorkerState
from epdserve.serving.api.errors import APIError

log = logging.getLogger("epdserve.router")

# Elastic: a colocated worker decodes an imported request as a decode worker does.
ELASTIC_FALLBACK = {"decode": "colocated"}
TAKEOVER_SILENCE_S = 1.0  # 2 heartbeat intervals: a worker this silent may be replaced by another process
RESET_RETRY_S = 2.0  # how often a down worker that is heard again is sent Reset until it says Hello
JOIN_GRACE_S = 1.0  # 2 heartbeat intervals: an unknown worker's Hello, queued while no router was bound, comes first
MAX_REFUSED = 64  # refused workers listed in /health (the oldest are forgotten)


class WorkerPort(Protocol):
    def connect(self, worker_id: str, addr: str, incarnation: str) -> None:
        """Replaces any channel of that id; sealed for ``incarnation``."""

    def disconnect(self, worker_id: str) -> None:
        """No-op for an id without a channel."""

    def send(self, worker_id: str, msg) -> None:
        """Never blocks. Raises WorkerFailed: its command queue is full (it stopped reading)."""

    def send_once(self, worker_id: str, addr: str, msg: P.Refused | P.Reset) -> None:
        """To a worker without a channel: once, sealed for ``msg.incarnation``, never blocking for long;
        failures are logged, not raised."""


class Inbox(Protocol):
    def deliver(self, event) -> None:
        """Queue an :mod:`~epdserve.serving.router.events` event for the request."""


@dataclass
class Compat:
    fingerprint: str
    kv_shape: dict
    embedding_shape: dict | None = None  # None: no vision model
    auth_token: str | None = None


class Registry:
    """``worker_timeout_s``: read-clock seconds. Raises ValueError: an unknown mode, or elastic with epd."""

    def __init__(self, mode: str, port: WorkerPort, compat: Compat, *, worker_timeout_s: float = 5.0,
                 metrics: RouterMetrics | None = None, elastic: bool = False,
                 on_event: Callable[[dict], None] | None = None):
        if mode not in MODE_ROLES:
            raise ValueError(f"unknown mode {mode!r} (expected one of {', '.join(MODE_ROLES)})")
        if elastic and mode == "epd":
            raise ValueError("elastic serving switches colocated, prefill and decode workers; epd is not supported")
        self.mode = mode
        self.elastic = elastic
        self.on_event = on_event or (lambda line: None)
        self.port = port
        self.compat = compat
        self.worker_timeout_s = worker_timeout_s
        self.metrics = metrics or RouterMetrics()
        self.workers: dict[str, WorkerState] = {}
        self.refused: dict[str, dict] = {}  # worker id -> its /health entry
        self.requests: dict[str, Inbox] = {}
        self.clock = 0.0  # read clock (s): see advance
        self.unknown: dict[str, float] = {}  # incarnation of an unknown worker -> when first heard
        self.invited: dict[str, float] = {}  # incarnation of an unknown worker -> when last sent Reset
        self.gone: set[str] = set()  # incarnations refused or removed: never invited back

    def live(self, w: WorkerState) -> bool:
        return w.dead is None

    def ready(self) -> bool:
        """Every role the mode needs has a live worker (elastic: some :meth:`serving_path`)."""
        if self.elastic:
            return self.serving_path() is not None
        return all(self.has_live(role) for role in MODE_ROLES[self.mode])

    def has_live(self, role: str) -> bool:
        return any(w.role == role and self.live(w) and not w.retiring for w in self.workers.values())

    def serving_path(self) -> str | None:
        """Elastic: the path a text request takes with the roles live now, or None."""
        if self.has_live("prefill") and (self.has_live("decode") or self.has_live("colocated")):
            return "disaggregated"
        if self.has_live("colocated"):
            return "colocated"
        return "local" if self.has_live("decode") else None

    def advance(self, seconds: float) -> None:
        """Seconds the events loop could read: a router stall is never blamed on a worker."""
        self.clock += seconds

    def check_silence(self) -> None:
        for w in list(self.workers.values()):
            if not w.dead and self.clock - w.heard > self.worker_timeout_s:
                self.mark_dead(w.worker_id, f"silent for {self.worker_timeout_s:g} s")

    def mark_dead(self, worker_id: str, reason: str) -> None:
        """Down until it says Hello again; its requests get ``WorkerDown`` at once."""
        w = self.workers.get(worker_id)
        if w is None or w.dead:
            return
        w.dead = reason
        log.error("worker %s (%s) is down: %s", worker_id, w.role, reason)
        self.metrics.set_worker_up(worker_id, w.role, False)
        for request_id in w.outstanding:
            inbox = self.requests.get(request_id)
            if inbox is not None:
                inbox.deliver(WorkerDown(worker_id, reason))
        w.outstanding.clear()

    def pick(self, role: str, prompt: PromptBlocks | None = None, policy: PrefixAware | None = None,
             exclude: WorkerState | None = None) -> WorkerState:
        """By ``policy``, else fewest outstanding requests, then tokens. Raises APIError 503: none live."""
        def of(r: str) -> list[WorkerState]:
            return [w for w in self.workers.values()
                    if w.role == r and self.live(w) and not w.retiring and w is not exclude]

        candidates = of(role)
        if not candidates and self.elastic and role in ELASTIC_FALLBACK:
            candidates = of(ELASTIC_FALLBACK[role])
        if not candidates:
            raise APIError(f"no live {role} worker", status=503, type="service_unavailable")
        if policy is not None and prompt is not None:
            return policy.choose(candidates, prompt)
        return min(candidates, key=load)

    def encoders(self) -> list[WorkerState]:
        """Least loaded (then by id) first."""
        return sorted((w for w in self.workers.values() if w.role == "encode" and self.live(w)),
                      key=lambda w: (len(w.outstanding), w.worker_id))

    def send(self, w: WorkerState, msg) -> None:
        """Raises WorkerFailed if its command queue is full."""
        self.port.send(w.worker_id, msg)

    def send_quietly(self, w: WorkerState, msg) -> None:
        """Logs instead of raising; skips a worker replaced since (the new process never held it)."""
        if self.workers.get(w.worker_id) is not w:
            return
        try:
            self.port.send(w.worker_id, msg)
        except WorkerFailed as exc:
            log.warning("could not send %s to %s: %s", msg.type, w.worker_id, exc)

    def set_role(self, worker_id: str, role: str, reason: str = "") -> None:
        """Elastic: routed by ``role`` at once, it drains what it holds until ``RoleSwitched``. Raises
        ValueError (not elastic, unknown or down worker, not an engine role), WorkerFailed (queue full)."""
        w = self.workers.get(worker_id)
        if not self.elastic or role not in ENGINE_ROLES or w is None or w.dead:
            raise ValueError(f"cannot switch worker {worker_id!r} to {role!r} (elastic: {self.elastic}, "
                             f"worker {'unknown' if w is None else 'down' if w.dead else 'up'})")
        if role == w.role:
            return
        switch_id = secrets.token_hex(6)
        self.port.send(worker_id, P.SetRole(role=role, switch_id=switch_id))
        previous, w.role, w.switch_id, w.switch_reason = w.role, role, switch_id, reason or None
        self.metrics.set_worker_up(worker_id, previous, False)
        self.metrics.set_worker_up(worker_id, role, True)
        self.metrics.set_role(worker_id, role)
        log.info("worker %s: %s -> %s (%s)", worker_id, previous, role, reason or "asked")
        self._role_event(w, "switching", previous, reason=reason or None)

    def retire(self, worker_id: str, reason: str) -> None:
        """Elastic: no new work; it finishes what it holds. Raises ValueError if not live."""
        w = self.workers.get(worker_id)
        if w is None or w.dead or not self.elastic:
            raise ValueError(f"cannot retire worker {worker_id!r}: not a live elastic worker")
        w.retiring = True
        log.info("worker %s (%s) is retiring: %s", worker_id, w.role, reason)
        self._role_event(w, "retiring", w.role, reason=reason)

    def remove(self, worker_id: str, reason: str) -> None:
        w = self.workers.pop(worker_id, None)
        if w is None:
            return
        self.gone.add(w.incarnation)
        if not w.dead:
            try:
                self.port.send(worker_id, P.Shutdown())
            except WorkerFailed as exc:
                log.warning("could not send Shutdown to %s: %s", worker_id, exc)
        self.port.disconnect(worker_id)
        self.metrics.set_worker_up(worker_id, w.role, False)
        log.info("worker %s (%s) removed: %s", worker_id, w.role, reason)
        self._role_event(w, "removed", w.role, reason=reason)

    def _on_role_switched(self, w: WorkerState, msg: P.RoleSwitched) -> None:
        if msg.switch_id != w.switch_id:
            return  # answers a SetRole that a later one replaced
        w.switch_id, w.announced = None, msg.role
        if msg.previous != msg.role:  # not asked back to its role while draining: a switch
            self.metrics.role_switched(w.worker_id, msg.previous, msg.role, msg.drain_ms / 1e3)
        log.info("worker %s is now %s (was %s; drained in %.0f ms)", w.worker_id, msg.role, msg.previous,
                 msg.drain_ms)
        self._role_event(w, "switched", msg.previous, drain_ms=round(msg.drain_ms, 3), reason=w.switch_reason)

    def _role_event(self, w: WorkerState, state: str, previous: str | None, drain_ms: float | None = None,
                    reason: str | None = None) -> None:
        if self.elastic:  # a static deployment's trace holds request lines only
            self.on_event({"event": "role", "at": time.time(), "worker": w.worker_id, "role": w.role,
                           "previous": previous, "state": state, "drain_ms": drain_ms, "reason": reason})

    def shutdown_workers(self) -> None:
        for w in self.workers.values():
            if not w.dead:
                self.send_quietly(w, P.Shutdown())

    def on_message(self, msg, now: float) -> None:
        if isinstance(msg, P.Hello):
            self.on_hello(msg)
            return
        w = self.workers.get(msg.worker_id)
        if w is None:
            if isinstance(msg, P.Heartbeat):
                self._invite(msg, now)
            return
        if isinstance(msg, P.Heartbeat):
            if msg.incarnation != w.incarnation:
                return  # another process claiming this id
            if w.dead:
                self._reset(w, now)
        w.last_seen, w.heard = now, self.clock
        if isinstance(msg, P.Stats):
            self._on_stats(w, msg)
        elif isinstance(msg, (P.Output, P.Error, P.Encoded)):
            self._on_request_message(w, msg)
        elif isinstance(msg, P.RoleSwitched):
            self._on_role_switched(w, msg)

    def _on_stats(self, w: WorkerState, msg: P.Stats) -> None:
        w.blocks_total, w.blocks_in_use = msg.blocks_total, msg.blocks_in_use
        w.num_running, w.num_waiting, w.num_preemptions = msg.num_running, msg.num_waiting, msg.num_preemptions
        w.stats_seen = w.last_seen
        self.metrics.set_worker(w.worker_id, w.role, blocks_in_use=msg.blocks_in_use,
                                blocks_total=msg.blocks_total, num_running=msg.num_running,
                                num_waiting=msg.num_waiting, num_preemptions=msg.num_preemptions,
                                prefix_cache_queries=msg.prefix_cache_queries,
                                prefix_cache_hits=msg.prefix_cache_hits,
                                mm_cache_queries=msg.mm_cache_queries, mm_cache_hits=msg.mm_cache_hits,
                                num_steps=msg.num_steps, last_step_tokens=msg.last_step_tokens)

    def _on_request_message(self, w: WorkerState, msg: P.Output | P.Error | P.Encoded) -> None:
        if not isinstance(msg, P.Output) or msg.finished or msg.kv is not None:
            w.outstanding.pop(msg.request_id, None)
        inbox = self.requests.get(msg.request_id)
        if inbox is not None:
            inbox.deliver(event_for(msg))
        elif isinstance(msg, P.Encoded) or (isinstance(msg, P.Output) and msg.kv is not None):
            # its client left before the KV or embeddings came: no flow will release them
            self.send_quietly(w, P.ReleaseKV(request_id=msg.request_id))

    def _reset(self, w: WorkerState, now: float) -> None:
        """A down worker heard again drops what it held and says Hello (asked at most every RESET_RETRY_S)."""
        if now - w.reset_sent < RESET_RETRY_S:
            return
        w.reset_sent = now
        log.warning("worker %s (%s) is heard again after it went down (%s); resetting it", w.worker_id, w.role,
                    w.dead)
        self.send_quietly(w, P.Reset(incarnation=w.incarnation))

    def _invite(self, msg: P.Heartbeat, now: float) -> None:
        """A worker that beats but never said Hello to this router joined an earlier router process:
        ``Reset`` makes it drop that router's requests and exports and say Hello here (asked once it beat
        for JOIN_GRACE_S without a Hello, then at most every RESET_RETRY_S; never a refused or removed one)."""
        if not msg.addr or msg.incarnation in self.gone:
            return
        first = self.unknown.setdefault(msg.incarnation, now)
        if now - first < JOIN_GRACE_S or now - self.invited.get(msg.incarnation, -RESET_RETRY_S) < RESET_RETRY_S:
            return
        self.invited[msg.incarnation] = now
        log.warning("worker %s beats but never said hello to this router (it joined an earlier one): resetting it",
                    msg.worker_id)
        self.port.send_once(msg.worker_id, msg.addr, P.Reset(incarnation=msg.incarnation))

    def on_hello(self, msg: P.Hello) -> None:
        """A live worker's id is taken over only after ``TAKEOVER_SILENCE_S``; a refusal leaves its state."""
        old = self.workers.get(msg.worker_id)
        if old is not None and not old.dead:
            if msg.incarnation == old.incarnation:
                log.debug("worker %s said hello again", msg.worker_id)
                return
            if self.clock - old.heard <= TAKEOVER_SILENCE_S:
                self._refuse(msg, f"worker id {msg.worker_id} is held by a live worker process (at {old.addr})",
                             held=True)
                return
        reason = self._refusal(msg)
        if reason is not None:
            self._refuse(msg, reason, held=old is not None)
            return
        if old is not None:
            if old.dead is None:
                self.mark_dead(msg.worker_id, "replaced by a new process")
            elif old.incarnation == msg.incarnation:
                log.info("worker %s (%s) is back after a reset", msg.worker_id, msg.role)
            self.port.disconnect(msg.worker_id)
            if old.role != msg.role:  # the id now names another role
                self.metrics.set_worker_up(msg.worker_id, old.role, False)
        self._admit(msg)
        if self.elastic and old is not None and old.announced and old.announced != msg.role:
            # a restarted process comes up in its first role and holds nothing: switch back now
            self.set_role(msg.worker_id, old.announced, f"restarted: back to its last announced role {old.announced}")

    def _refusal(self, msg: P.Hello) -> str | None:
        roles = ENGINE_ROLES if self.elastic else MODE_ROLES[self.mode]
        if msg.role not in roles:
            kind = "an elastic" if self.elastic else f"a {self.mode}"
            return f"worker {msg.worker_id} has role {msg.role}, {kind} router uses {roles}"
        peer_role = KV_PEER_ROLES.get(msg.role) if self.mode in ("pd", "epd") else None
        peers = [(w.worker_id, w.kv_layout) for w in self.workers.values()
                 if (self.elastic or w.role == peer_role) and self.live(w) and w.worker_id != msg.worker_id]
        kv_shape = self.compat.embedding_shape if msg.role == "encode" else self.compat.kv_shape
        return refusal(msg, fingerprint=self.compat.fingerprint, kv_shape=kv_shape,
                       auth_token=self.compat.auth_token, peers=peers)

    def _admit(self, msg: P.Hello) -> None:
        self.unknown.pop(msg.incarnation, None)
        self.invited.pop(msg.incarnation, None)
        self.port.connect(msg.worker_id, msg.addr, msg.incarnation)
        self.refused.pop(msg.worker_id, None)
        self.workers[msg.worker_id] = WorkerState(worker_id=msg.worker_id, role=msg.role, addr=msg.addr,
                                                  model=msg.model, kv_layout=msg.kv_layout, cores=msg.cores,
                                                  blocks_total=msg.blocks_total, incarnation=msg.incarnation,
                                                  heard=self.clock, node_id=msg.node_id, node_ip=msg.node_ip,
                                                  resources=dict(msg.resources), pid=msg.pid,
                                                  weight_format=msg.weight_format, tuned=msg.model_dump()["tuned"],
                                                  tensor_parallel_size=msg.tensor_parallel_size, announced=msg.role,
                                                  engine=dict(msg.engine))
        self.metrics.set_worker_node(msg.worker_id, msg.role, msg.node_id, msg.node_ip)
        self.metrics.set_role(msg.worker_id, msg.role)
        self.metrics.set_worker(msg.worker_id, msg.role, blocks_in_use=0, blocks_total=msg.blocks_total,
                                num_running=0, num_waiting=0, num_preemptions=0)
        self.metrics.set_worker_up(msg.worker_id, msg.role, True)
        log.info("worker %s (%s) is up: hello from %s, cores %s, node %s", msg.worker_id, msg.role, msg.addr,
                 msg.cores, msg.node_id or "?")
        self._role_event(self.workers[msg.worker_id], "up", None)

    def _refuse(self, msg: P.Hello, reason: str, held: bool) -> None:
        """No tokenless ``Refused`` to a held id: an unauthenticated Hello could name a live worker's address."""
        log.error("refused worker %s (%s) from %s: %s", msg.worker_id, msg.role, msg.addr, reason)
        self.gone.add(msg.incarnation)
        if not held:
            self.refused.pop(msg.worker_id, None)
            self.refused[msg.worker_id] = {"worker_id": msg.worker_id, "role": msg.role, "addr": msg.addr,
                                           "cores": msg.cores, "state": "refused", "reason": reason,
                                           "kv_dtype": msg.kv_layout.get("dtype"), "weight_format": msg.weight_format,
                                           "tuned": msg.model_dump()["tuned"], "engine": dict(msg.engine),
                                           "tensor_parallel_size": msg.tensor_parallel_size, "blocks_in_use": 0,
                                           "blocks_total": 0, "num_running": 0, "num_waiting": 0, "outstanding": 0,
                                           "outstanding_tokens": 0, "node_id": msg.node_id, "node_ip": msg.node_ip,
                                           "resources": dict(msg.resources)}
            while len(self.refused) > MAX_REFUSED:
                self.refused.pop(next(iter(self.refused)))
            self.metrics.set_worker_up(msg.worker_id, msg.role, False)
        if held and not self.compat.auth_token:
            return
        self.port.send_once(msg.worker_id, msg.addr, P.Refused(reason=reason, incarnation=msg.incarnation))

    def health(self, now: float) -> list[dict]:
        """In worker id order (join order varies, on Ray above all), refused last; ``now``: ``time.monotonic()``."""
        ids = sorted(self.workers, key=natural_order)
        return [self.workers[i].as_json(now) for i in ids] + list(self.refused.values())
