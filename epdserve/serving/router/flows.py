"""One request's trip through the workers: one flow class per path.

* :class:`SingleWorkerFlow`: one worker produces every token: a colocated worker
  (path "colocated"), or in pd a decode worker that prefills a prompt shorter than
  ``--local-prefill-threshold`` itself (path "local").
* :class:`DisaggregatedFlow`: a prefill worker returns the first token and a KV
  descriptor; the first token goes to the client at once, then the descriptor and the
  first token go to a decode worker, which streams tokens 2..n.
* :class:`EncodeFlow` (epd, a request with images): the images go to encode workers first
  (spread over them); once every one has answered ``Encoded``, the request continues as
  a disaggregated one, its prefill worker getting the embedding frames instead of the
  image bytes.

Elastic (``serve --elastic``): a request's path is chosen by the roles live when it
arrives (:meth:`Registry.serving_path`), and each worker is used in the role it had when
the request was sent to it, whatever it switches to meanwhile (it finishes that work
first). A decode stage with no decode worker goes to a colocated one.

A flow is driven by the events (:mod:`~epdserve.serving.router.events`) the registry puts
on its queue. Transitions: a worker that goes down before the request's first output
(queued or prefilling) -> the request goes to another live worker of the role (nothing
reached the client yet; embeddings are dropped, the new worker encodes the images
itself); down after it -> 503. No event for ``request_timeout_s`` -> 504. What the
request holds on workers is tracked in :class:`~epdserve.serving.router.holdings.Holdings`
and given back in :meth:`Flow.close`, which every outcome ends in. Times come from
``FlowConfig.clock`` (seconds, default ``time.monotonic``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from epdserve.serving import protocol as P
from epdserve.serving.router.events import Encoded, Tick, WorkerDown, WorkerError, WorkerFailed, WorkerOutput
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
    """``mode``: the router's; ``request_timeout_s``: seconds without an event after which
    a request fails (504); ``local_prefill_threshold`` (pd, tokens): a shorter prompt is
    prefilled by its decode worker; ``poll_s``: how often a waiting flow ticks;
    ``clock``: seconds, monotonic; ``routing``: how a request's first worker (colocated or
    prefill) is chosen among its role's, a :class:`PrefixAware` policy or None for
    least-loaded (``--routing``; decode workers are always least-loaded); ``elastic``:
    paths by the roles live (``serve --elastic``), ``signals`` told of every arrival,
    first token and inter-output gap."""

    mode: str
    request_timeout_s: float = 600.0
    local_prefill_threshold: int = 0
    poll_s: float = 1.0
    clock: Callable[[], float] = field(default=time.monotonic)
    routing: PrefixAware | None = None
    elastic: bool = False
    signals: SignalRecorder | None = None  # elastic: what the controller reads of each request


def new_flow(registry: Registry, config: FlowConfig, request_id: str, prompt_ids: list[int],
             sampling: P.SamplingParams, t_arrival: float, images: list[P.ImageRef] = ()) -> Flow:
    """The flow of a request with these prompt ids and images (with their bytes), by mode
    and path (elastic: by the roles live now); ``t_arrival``: its arrival on ``config.clock``."""
    path = registry.serving_path() if config.elastic else None
    if config.mode == "colocated" and not config.elastic or path == "colocated":
        cls = SingleWorkerFlow
    elif path == "local":
        cls = LocalPrefillFlow
    elif len(prompt_ids) < config.local_prefill_threshold and not images:
        cls = LocalPrefillFlow
    elif config.mode == "epd" and images:
        cls = EncodeFlow
    else:
        cls = DisaggregatedFlow
    return cls(registry, config, request_id, prompt_ids, sampling, t_arrival, images)


class Flow:
    """What every path shares. :meth:`start` sends the request to its first worker(s);
    :meth:`tokens` yields :data:`Tokens`; :meth:`close` must be called on every outcome
    and is idempotent."""

    path = "colocated"
    first_role = "colocated"

    def __init__(self, registry: Registry, config: FlowConfig, request_id: str, prompt_ids: list[int],
                 sampling: P.SamplingParams, t_arrival: float, images: list[P.ImageRef] = ()):
        self.registry, self.config, self.clock = registry, config, config.clock
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.images = list(images)  # with their bytes
        # The prompt's block keys, made only when a policy routes by them.
        self.blocks = PromptBlocks(prompt_ids, [im.hash for im in self.images]) if config.routing else None
        self.embeddings: list[P.EmbeddingRef] = []
        self.encoders: dict[str, tuple[WorkerState, list[int]]] = {}  # epd: id -> (worker, its images)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.held = Holdings(registry, request_id)
        self.worker: WorkerState | None = None  # whose outputs the flow awaits
        self.worker_role = ""  # the role it was sent the request in (elastic: it may switch since)
        self.prefill_worker: WorkerState | None = None
        self.decode_worker: WorkerState | None = None
        self.closed = False
        self.t_arrival = t_arrival
        self.t_dispatch: float | None = None
        self.t_first: float | None = None
        self.t_sent: float | None = None  # the last AddRequest handed to the port
        self.t_end: float | None = None
        self.output_tokens = 0
        self.cached_tokens = 0  # prompt tokens its first worker found in its prefix cache
        self.prompt_logprobs: list | None = None  # Output.prompt_logprobs of its first output, if asked
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.itls_s: list[float] = []  # gaps between outputs reaching the router (s)
        # Elastic: the mode is the path's, as a static deployment serving the same path writes it.
        mode = ("colocated" if self.path == "colocated" else "pd") if config.elastic else config.mode
        self.record = RequestTrace(request_id=request_id, mode=mode, path=self.path,
                                   prompt_tokens=len(prompt_ids), max_tokens=sampling.max_tokens)

    def note_itl(self, gap_s: float) -> None:
        """Record a gap of ``gap_s`` seconds between two outputs reaching the client."""
        self.itls_s.append(gap_s)
        if self.config.signals is not None:
            self.config.signals.itl(gap_s * 1e3)

    def deliver(self, event) -> None:
        """Queue an event for this request (the registry calls it)."""
        self.queue.put_nowait(event)

    def start(self) -> None:
        """Register the request and send it on (see the subclass's :meth:`_begin`).

        Raises:
            APIError: 503, no live worker of the role it needs.
            WorkerFailed: that worker's command queue is full.
        """
        self.registry.requests[self.request_id] = self
        self.t_dispatch = self.clock()
        if self.config.signals is not None:
            self.config.signals.arrival(len(self.prompt_ids), self.sampling.max_tokens)
        self._begin()

    def _begin(self) -> None:
        self._dispatch(self._choose(self.first_role), self.first_role)

    def _choose(self, role: str, exclude: WorkerState | None = None) -> WorkerState:
        """A live worker of ``role`` (not ``exclude``): by ``config.routing`` for the role
        that prefills (colocated, prefill), least-loaded otherwise. Raises APIError 503 if none."""
        prefills = role in ("colocated", "prefill")
        return self.registry.pick(role, self.blocks if prefills else None, self.config.routing, exclude)

    def tokens(self) -> AsyncIterator[Tokens]:
        """Yield each worker output's ``(token_ids, logprobs, finish_reason)``; the reason
        is None until the last one. Call :meth:`start` first.

        Raises:
            WorkerFailed: a worker rejected (400) or failed (5xx) the request, went down
                with it (503), or went silent (504); no live worker to go on with (503).
        """
        raise NotImplementedError

    # -- sending
    def _dispatch(self, worker: WorkerState, role: str, **kw) -> None:
        """Send the request to ``worker`` for the stage of ``role`` (``kw``: AddRequest's
        KV hand-off fields)."""
        if role == "prefill":
            self.prefill_worker = worker
        elif role == "decode":
            self.decode_worker = worker
        if self.images:
            # Only a worker that encodes them gets the bytes; the rest need the hashes.
            encodes_here = role != "decode" and not self.embeddings
            kw["images"] = self.images if encodes_here else [im.model_copy(update={"data": None})
                                                            for im in self.images]
            kw["embeddings"] = self.embeddings
        sampling = self.sampling
        if kw.get("kv") is not None and sampling.prompt_logprobs is not None:
            # The prefill worker scored the prompt; an importing decode worker never needs to.
            sampling = sampling.model_copy(update={"prompt_logprobs": None})
        msg = P.AddRequest(request_id=self.request_id, prompt_token_ids=self.prompt_ids, sampling=sampling, **kw)
        self.worker, self.worker_role = worker, role
        self.held.hold(worker, len(self.prompt_ids) + self.sampling.max_tokens, exports_kv=role == "prefill")
        # Stamped before the send: a worker's stamps then start after it (the router may
        # lose the CPU between the send and a later stamp while the worker goes on).
        self.t_sent = self.clock()
        self.registry.send(worker, msg)

    def _pick(self, role: str, exclude: WorkerState | None = None) -> WorkerState:
        """A live worker of ``role`` (not ``exclude``) to go on with. Raises WorkerFailed 503 if none."""
        try:
            return self._choose(role, exclude)
        except APIError as exc:
            raise WorkerFailed(exc.message, 503) from None

    # -- waiting
    async def _poll(self):
        """The next event, or :class:`Tick` after ``poll_s`` without one."""
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancel (client gone) that lands
        # as a message arrives, and the request then runs on for nobody.
        try:
            async with asyncio.timeout(self.config.poll_s):
                return await self.queue.get()
        except TimeoutError:
            return Tick()

    async def _next(self) -> P.Output:
        """The next Output of the current worker.

        Raises:
            WorkerFailed: the worker sent Error (with its status), died (503) or went silent (504).
        """
        worker, timeout = self.worker, self.config.request_timeout_s
        silent_since = self.clock()
        while True:
            event = await self._poll()
            if isinstance(event, (Tick, WorkerDown)):
                if worker.dead:
                    self.held.lost(worker)
                    raise WorkerFailed(f"worker {worker.worker_id} died ({worker.dead})", 503)
                if self.clock() - silent_since > timeout:
                    raise WorkerFailed(f"no output from worker {worker.worker_id} for {timeout:.0f} s", 504)
                continue
            if event.worker_id != worker.worker_id:
                continue  # a late message of a worker we left
            if isinstance(event, WorkerError):
                self.held.done(worker, failed=True)
                verb = "rejected" if event.msg.status < 500 else "failed"
                raise WorkerFailed(f"worker {worker.worker_id} {verb} the request: {event.msg.message}",
                                   event.msg.status)
            if isinstance(event, WorkerOutput):
                if event.msg.finished:
                    self.held.done(worker)
                self.record.add(self.worker_role, event.msg.timings)
                return event.msg

    async def _first(self) -> P.Output:
        """The first output; if the worker goes down before it, the request goes to another
        live worker of the role (nothing reached the client yet, so nothing is repeated).

        Raises:
            WorkerFailed: as :meth:`_next`; 503 if no other worker of the role is live.
        """
        while True:
            try:
                out = await self._next()
                break
            except WorkerFailed as exc:
                dead, role = self.worker, self.worker_role
                if not dead.dead:
                    raise
                try:
                    worker = self._choose(role)
                except APIError:
                    raise WorkerFailed(f"{exc}; no other live {role} worker to retry on", 503) from None
                log.warning("%s: %s; retrying on %s", self.request_id, exc, worker.worker_id)
                # The dead worker may have read, and so deleted, the embedding frames: the
                # next one gets the image bytes and encodes them itself.
                self.embeddings = []
                self._dispatch(worker, role)
        self.t_first = self.clock()
        if self.config.signals is not None:
            queue_ms = (self.t_dispatch - self.t_arrival + (out.timings.queue_ms or 0.0) / 1e3) * 1e3
            self.config.signals.first_token((self.t_first - self.t_arrival) * 1e3, queue_ms,
                                            len(self.prompt_ids) - (out.num_cached_tokens or 0))
        self.cached_tokens = self.record.cached_tokens = out.num_cached_tokens  # in pd, the prefill worker's
        self.prompt_logprobs = out.prompt_logprobs
        return out

    async def _stream(self, out: P.Output) -> AsyncIterator[Tokens]:
        """Yield ``out`` and every later output of the current worker, to the last."""
        while True:
            yield out.token_ids, out.logprobs, (out.finish_reason or "stop") if out.finished else None
            if out.finished:
                return
            out = await self._next()

    # -- the end
    def close(self) -> list[tuple[str, str]]:
        """Free the request everywhere (:meth:`Holdings.settle`). Idempotent. Returns what
        was sent, as ``(worker id, message type)``."""
        if self.closed:
            return []
        self.closed = True
        self.t_end = self.clock()
        self.registry.requests.pop(self.request_id, None)
        return self.held.settle()

    def trace(self) -> RequestTrace:
        """The request's trace record (see :mod:`epdserve.trace` for every stage). Its
        ``finish_reason`` is vLLM's, as ``/metrics`` counts it: the flow's, or "error" for
        a request that failed, or "abort" for one closed with neither (the client went away)."""
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
        if self.encoders:
            rec.encode_workers = sorted(self.encoders)
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

    async def tokens(self) -> AsyncIterator[Tokens]:
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

    async def tokens(self) -> AsyncIterator[Tokens]:
        out = await self._first()
        prefill = self.prefill_worker
        self.held.done(prefill)  # its one output: the request is off its queue
        self.worker = None
        if out.finished or out.kv is None:
            self.held.release_kv()
            if not out.finished:
                raise WorkerFailed(f"prefill worker {prefill.worker_id} sent no KV")
            yield out.token_ids, out.logprobs, out.finish_reason or "stop"
            return
        yield out.token_ids, out.logprobs, None  # the first token reaches the client before the hand-off
        # Never back to the prefill worker (elastic: it may be colocated by now): its engine
        # holds the request, under the same id, until the KV is released.
        self._dispatch(self._pick("decode", exclude=prefill), "decode", kv=out.kv, first_token=out.token_ids[-1])
        self.record.router_hop_ms = (self.t_sent - self.t_first) * 1000
        out = await self._next()
        self.record.handoff_gap_ms = (self.clock() - self.t_first) * 1000  # the second token is here
        # The decode worker imports the KV before its first step, so its first output
        # means the prefill worker's copy is no longer needed.
        self.held.release_kv()
        async for item in self._stream(out):
            yield item


class EncodeFlow(DisaggregatedFlow):
    """epd with images: encode workers -> prefill worker -> KV hand-off -> decode worker."""

    def _begin(self) -> None:
        """Deal the images round-robin to the live encode workers, least loaded first; each
        worker answers with one frame for its share.

        Raises:
            APIError: 503, no live encode worker.
        """
        workers = self.registry.encoders()
        if not workers:
            raise APIError("no live encode worker", status=503, type="service_unavailable")
        n = len(self.images)
        shares = [list(range(i, n, len(workers))) for i in range(min(len(workers), n))]
        for worker, indices in zip(workers, shares):
            self.encoders[worker.worker_id] = (worker, indices)
            self.held.encoding(worker)
            self.registry.send(worker, P.Encode(request_id=self.request_id, images=[self.images[i] for i in indices]))

    async def tokens(self) -> AsyncIterator[Tokens]:
        await self._encoded()
        self._dispatch(self._pick("prefill"), "prefill")
        async for item in super().tokens():
            yield item

    async def _encoded(self) -> None:
        """Wait for every encode worker's frame; keep the frames (``embeddings``) and their
        timings: ``encode_queue_ms`` and ``encode_ms`` of the worker that answered last (the
        critical path), ``embedding_bytes`` summed.

        Raises:
            WorkerFailed: an encode worker rejected the images (400), failed (500), died (503) or
                went silent (504).
        """
        waiting = dict(self.encoders)
        timeout = self.config.request_timeout_s
        silent_since = self.clock()
        while waiting:
            event = await self._poll()
            if isinstance(event, (Tick, WorkerDown)):
                dead = next((w for w, _ in waiting.values() if w.dead), None)
                if dead is not None:
                    self.held.lost(dead)
                    raise WorkerFailed(f"encode worker {dead.worker_id} died ({dead.dead})", 503)
                if self.clock() - silent_since > timeout:
                    raise WorkerFailed(f"no embeddings within {timeout:.0f} s", 504)
                continue
            if not isinstance(event, (Encoded, WorkerError)) or event.worker_id not in waiting:
                continue
            worker, indices = waiting.pop(event.worker_id)
            if isinstance(event, WorkerError):
                what = "rejected the images" if event.msg.status < 500 else "failed"
                raise WorkerFailed(f"encode worker {worker.worker_id} {what}: {event.msg.message}", event.msg.status)
            self.embeddings.append(P.EmbeddingRef(images=indices, frame=event.msg.frame))
            self.record.add("encode", event.msg.timings)
