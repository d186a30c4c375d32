"""One request's trip through the workers, one flow class per path
(:func:`~epdserve.serving.router.paths.flow_class`; epd with images:
:mod:`~epdserve.serving.router.epd_flow`). A worker down before the first output -> the
request is retried on another of the role; after it -> 503; no event for
``request_timeout_s`` -> 504. Elastic: each worker is used in the role it had when the
request went to it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Container

from epdserve.serving import protocol as P
from epdserve.serving.router.events import Tick, WorkerDown, WorkerError, WorkerFailed, WorkerOutput
from epdserve.serving.router.holdings import Holdings
from epdserve.serving.router.prefix_index import DEFAULT_POLICY, PrefixAware, PromptBlocks
from epdserve.serving.router.registry import Registry, WorkerState
from epdserve.serving.router.signals import SignalRecorder
from epdserve.trace import RequestTrace
from epdserve.serving.api.errors import APIError

log = logging.getLogger("epdserve.router")

# (token ids, logprobs as Output's, finish reason or None until the last)
Tokens = tuple[list[int], list | None, str | None]


@dataclass
class FlowConfig:
    """``local_prefill_threshold``: pd, tokens; ``clock``: seconds, monotonic; ``routing``: how
    the first worker is picked, None for least-loaded; ``signals``: elastic, told of every
    arrival, first token and output gap; ``migration_limit``: moves of a request whose worker
    died mid-stream (:meth:`Flow._next_or_migrate`)."""

    mode: str
    request_timeout_s: float = 600.0
    local_prefill_threshold: int = 0
    poll_s: float = 1.0
    clock: Callable[[], float] = field(default=time.monotonic)
    routing: PrefixAware | None = None
    elastic: bool = False
    signals: SignalRecorder | None = None
    migration_limit: int = 0


class Flow:
    """Every outcome ends in :meth:`close` (idempotent). The flow owns its output state."""

    path = "colocated"
    first_role = "colocated"

    def __init__(self, registry: Registry, config: FlowConfig, request_id: str, prompt_ids: list[int],
                 sampling: P.SamplingParams, t_arrival: float, images: list[P.ImageRef] = ()):
        self.registry, self.config = registry, config
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.images = list(images)  # with their bytes
        self.blocks = PromptBlocks(prompt_ids, [im.hash for im in self.images]) if config.routing else None
        self.events: asyncio.Queue = asyncio.Queue()
        self.holdings = Holdings(registry, request_id)
        self.worker: WorkerState | None = None  # whose outputs the flow awaits
        self.worker_role = ""  # the role it was sent the request in (elastic: it may have switched)
        self.prefill_worker: WorkerState | None = None
        self.decode_worker: WorkerState | None = None
        self.closed = False
        self.t_arrival = t_arrival
        self.t_dispatch: float | None = None
        self.t_first: float | None = None
        self.t_sent: float | None = None  # the last AddRequest handed to the port
        self.t_end: float | None = None
        self.output_ids: list[int] = []  # what reached the client: a migration computes them again
        self.cached_tokens = 0  # prompt tokens in its first worker's prefix cache
        self.prompt_logprobs: list | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.itls_s: list[float] = []  # gaps between outputs reaching the router
        # Elastic: the mode is the path's, as a static deployment serving it writes it.
        mode = ("colocated" if self.path == "colocated" else "pd") if config.elastic else config.mode
        self.record = RequestTrace(request_id=request_id, mode=mode, path=self.path,
                                   prompt_tokens=len(prompt_ids), max_tokens=sampling.max_tokens)

    def deliver(self, event) -> None:
        self.events.put_nowait(event)

    def start(self) -> None:
        """Raises APIError 503 (no live worker of the role), WorkerFailed (its queue is full)."""
        self.registry.requests[self.request_id] = self
        self.t_dispatch = self.config.clock()
        if self.config.signals is not None:
            self.config.signals.arrival(len(self.prompt_ids), self.sampling.max_tokens)
        self._begin()

    def _begin(self) -> None:
        self._dispatch(self._choose(self.first_role), self.first_role)

    def _choose(self, role: str, exclude: WorkerState | None = None) -> WorkerState:
        """By ``config.routing`` for the role that prefills. Raises APIError 503: none live."""
        prefills = role in ("colocated", "prefill")
        return self.registry.pick(role, self.blocks if prefills else None, self.config.routing, exclude)

    async def tokens(self) -> AsyncIterator[Tokens]:
        """Raises WorkerFailed: a worker rejected (400) or failed (5xx) it, died (503), went silent (504)."""
        last = None
        async for ids, logprobs, finish in self._outputs():
            now = self.config.clock()
            if last is not None:
                self._note_itl(now - last)
            last = now
            self.output_ids += ids
            if finish is not None:
                self.finish_reason = finish
            yield ids, logprobs, finish

    @property
    def output_tokens(self) -> int:
        return len(self.output_ids)

    def _outputs(self) -> AsyncIterator[Tokens]:
        raise NotImplementedError

    def _note_itl(self, gap_s: float) -> None:
        self.itls_s.append(gap_s)
        if self.config.signals is not None:
            self.config.signals.itl(gap_s * 1e3)

    def stop(self) -> None:
        self.finish_reason = "stop"

    def fail(self, exc: Exception) -> None:
        """It failed with ``exc``, or was abandoned with another choice that did, unless it finished."""
        if self.finish_reason is None:
            self.error = str(exc)

    def _dispatch(self, worker: WorkerState, role: str, **kw) -> None:
        """``kw``: AddRequest's KV hand-off fields."""
        if role == "prefill":
            self.prefill_worker = worker
        elif role == "decode":
            self.decode_worker = worker
        if self.images:
            kw.update(self._image_fields(role))
        sampling = self.sampling
        if (kw.get("kv") is not None or kw.get("resume_ids")) and sampling.prompt_logprobs is not None:
            # The first worker scored the prompt; one importing its KV or resuming its output never needs to.
            sampling = sampling.model_copy(update={"prompt_logprobs": None})
        msg = P.AddRequest(request_id=self.request_id, prompt_token_ids=self.prompt_ids, sampling=sampling, **kw)
        self.worker, self.worker_role = worker, role
        self.holdings.hold(worker, len(self.prompt_ids) + self.sampling.max_tokens, exports_kv=role == "prefill")
        # Stamped before the send: a worker's stamps then start after it.
        self.t_sent = self.config.clock()
        self.registry.send(worker, msg)

    def _image_fields(self, role: str) -> dict:
        """Only a worker that encodes the images gets their bytes; the rest need the hashes."""
        images = self.images if role != "decode" else [im.model_copy(update={"data": None}) for im in self.images]
        return {"images": images, "embeddings": []}

    def _pick(self, role: str, exclude: WorkerState | None = None) -> WorkerState:
        """Raises WorkerFailed 503 if no worker of ``role`` is live."""
        try:
            return self._choose(role, exclude)
        except APIError as exc:
            raise WorkerFailed(exc.message, 503) from None

    async def _poll(self):
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancel (client gone) that lands
        # as a message arrives, and the request then runs on for nobody.
        try:
            async with asyncio.timeout(self.config.poll_s):
                return await self.events.get()
        except TimeoutError:
            return Tick()

    async def _next(self) -> P.Output:
        """Raises WorkerFailed: the worker's Error (its status), death (503), silence (504)."""
        worker, timeout = self.worker, self.config.request_timeout_s
        silent_since, mine = self.config.clock(), {worker.worker_id}
        while True:
            event = self._down_if_lost(await self._poll(), mine)
            if isinstance(event, (Tick, WorkerDown)):
                if worker.dead:
                    self.holdings.lost(worker)
                    raise WorkerFailed(f"worker {worker.worker_id} died ({worker.dead})", 503)
                if self.config.clock() - silent_since > timeout:
                    raise WorkerFailed(f"no output from worker {worker.worker_id} for {timeout:.0f} s", 504)
                continue
            if event.worker_id != worker.worker_id:
                continue  # a late message of a worker we left
            if isinstance(event, WorkerError):
                self.holdings.done(worker, failed=True)
                verb = "rejected" if event.msg.status < 500 else "failed"
                raise WorkerFailed(f"worker {worker.worker_id} {verb} the request: {event.msg.message}",
                                   event.msg.status)
            if isinstance(event, WorkerOutput):
                if event.msg.finished:
                    self.holdings.done(worker)
                self.record.add(self.worker_role, event.msg.timings)
                return event.msg

    def _down_if_lost(self, event, worker_ids: Container[str]):
        """``event``, or the WorkerDown it means: an Error with ``worker_lost`` (its tensor-parallel ranks
        failed) from one of ``worker_ids`` takes that worker for down at once when requests may move, so
        that its requests, this one too, move as from a dead worker."""
        if (isinstance(event, WorkerError) and event.msg.worker_lost and event.worker_id in worker_ids
                and self.config.migration_limit):
            self.registry.mark_dead(event.worker_id, event.msg.message)
            return WorkerDown(event.worker_id, event.msg.message)
        return event

    async def _first(self) -> P.Output:
        """A worker down before it is replaced (nothing reached the client). Raises as :meth:`_next`."""
        while True:
            try:
                out = await self._next()
                break
            except WorkerFailed as exc:
                if not self.worker.dead:
                    raise
                worker = self._replacement(exc, "retry on")
                log.warning("%s: %s; retrying on %s", self.request_id, exc, worker.worker_id)
                self._retry(worker, self.worker_role)
        self.t_first = self.config.clock()
        if self.config.signals is not None:
            queue_ms = (self.t_dispatch - self.t_arrival + (out.timings.queue_ms or 0.0) / 1e3) * 1e3
            self.config.signals.first_token((self.t_first - self.t_arrival) * 1e3, queue_ms,
                                            len(self.prompt_ids) - (out.num_cached_tokens or 0))
        self.cached_tokens = self.record.cached_tokens = out.num_cached_tokens  # in pd, the prefill worker's
        self.prompt_logprobs = out.prompt_logprobs
        return out

    def _retry(self, worker: WorkerState, role: str) -> None:
        self._dispatch(worker, role)

    def _replacement(self, exc: WorkerFailed, purpose: str) -> WorkerState:
        """A live worker of the dead worker's role. Raises WorkerFailed 503 naming ``purpose``: none."""
        try:
            return self._choose(self.worker_role, exclude=self.worker)
        except APIError:
            raise WorkerFailed(f"{exc}; no other live {self.worker_role} worker to {purpose}", 503) from None

    async def _next_or_migrate(self) -> P.Output:
        """:meth:`_next`; when its worker died, the request moves to a live worker of the same role with the
        output the client has (:attr:`output_ids`), computed again there with the prompt, at most
        ``config.migration_limit`` times a request. Not a decode worker's request with images (it would need
        their embeddings). Raises as :meth:`_next`; WorkerFailed 503 at once with no live worker to move to."""
        while True:
            try:
                return await self._next()
            except WorkerFailed as exc:
                dead, role = self.worker, self.worker_role
                moves = self.record.migrations or []
                if not dead.dead or not self.config.migration_limit or (self.images and role == "decode"):
                    raise
                if len(moves) >= self.config.migration_limit:
                    raise WorkerFailed(f"{exc}; moved {len(moves)} times already (--migration-limit)", 503) from None
                worker = self._replacement(exc, "move it to")
                log.warning("%s: %s; moving it with its %d output tokens to %s", self.request_id, exc,
                            len(self.output_ids), worker.worker_id)
                self.record.migrations = [*moves, {"from": dead.worker_id, "to": worker.worker_id,
                                                   "recomputed_tokens": len(self.prompt_ids) + len(self.output_ids)}]
                self._dispatch(worker, role, resume_ids=list(self.output_ids))

    async def _stream(self, out: P.Output) -> AsyncIterator[Tokens]:
        while True:
            yield out.token_ids, out.logprobs, (out.finish_reason or "stop") if out.finished else None
            if out.finished:
                return
            out = await self._next_or_migrate()

    def close(self) -> list[tuple[str, str]]:
        """Give back its holdings; what was sent, as ``(worker id, message type)``."""
        if self.closed:
            return []
        self.closed = True
        self.t_end = self.config.clock()
        self.registry.requests.pop(self.request_id, None)
        return self.holdings.settle()

    def end(self) -> RequestTrace:
        self.close()
        return self.trace()

    def trace(self) -> RequestTrace:
        """Its ``finish_reason`` as /metrics counts it: the flow's, else "error" (failed) or
        "abort" (closed with neither: the client went away)."""
        rec = self.record
        rec.output_tokens, rec.error = self.output_tokens, self.error
        rec.finish_reason = self.finish_reason or ("error" if self.error is not None
                                                   else "abort" if self.closed else None)
        rec.prefill_worker = self.prefill_worker.worker_id if self.prefill_worker else None
        rec.decode_worker = self.decode_worker.worker_id if self.decode_worker else None
        rec.prefill_node = self.prefill_worker.node_id or None if self.prefill_worker else None
        rec.decode_node = self.decode_worker.node_id or None if self.decode_worker else None
        if self.path == "colocated":
            rec.worker = getattr(self.worker, "worker_id", None)
        if self.images:
            rec.num_images = len(self.images)
        rec.routing = self.config.routing.name if self.config.routing else DEFAULT_POLICY
        decision = self.blocks.decision if self.blocks else None
        if decision is not None:
            rec.routing_reason, rec.routing_believed_tokens = decision.reason, decision.believed_tokens
        rec.router_queue_ms = _ms(self.t_arrival, self.t_dispatch)
        rec.ttft_ms = _ms(self.t_arrival, self.t_first)
        rec.e2e_ms = _ms(self.t_arrival, self.t_end)
        return rec


def _ms(t0: float | None, t1: float | None) -> float | None:
    return None if t0 is None or t1 is None else round((t1 - t0) * 1000, 3)


class SingleWorkerFlow(Flow):
    """Colocated: one colocated worker from the first token to the last."""

    async def _outputs(self) -> AsyncIterator[Tokens]:
        out = await self._first()
        async for item in self._stream(out):
            yield item


class LocalPrefillFlow(SingleWorkerFlow):
    """pd, a prompt under the local-prefill threshold: a decode worker prefills it itself."""

    path = "local"
    first_role = "decode"


class DisaggregatedFlow(Flow):
    """prefill worker -> KV hand-off -> decode worker."""

    path = "disaggregated"
    first_role = "prefill"

    async def _outputs(self) -> AsyncIterator[Tokens]:
        out = await self._first()
        prefill = self.prefill_worker
        self.holdings.done(prefill)  # its one output: the request is off its queue
        self.worker = None
        if out.finished or out.kv is None:
            self.holdings.release_kv()
            if not out.finished:
                raise WorkerFailed(f"prefill worker {prefill.worker_id} sent no KV")
            yield out.token_ids, out.logprobs, out.finish_reason or "stop"
            return
        yield out.token_ids, out.logprobs, None  # the first token reaches the client before the hand-off
        # Never back to the prefill worker (elastic: it may be colocated by now): its engine
        # holds the request, under the same id, until the KV is released.
        self._dispatch(self._pick("decode", exclude=prefill), "decode", kv=out.kv, first_token=out.token_ids[-1])
        self.record.router_hop_ms = (self.t_sent - self.t_first) * 1000
        out = await self._next_or_migrate()
        self.record.handoff_gap_ms = (self.config.clock() - self.t_first) * 1000  # the second token is here
        # Imported before the decode worker's first step: the prefill worker's copy can go.
        self.holdings.release_kv()
        async for item in self._stream(out):
            yield item
