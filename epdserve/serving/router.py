"""The router: an OpenAI-compatible HTTP front that drives colocated, PD or EPD workers.

It tokenizes each request once, picks a worker per role (least outstanding requests,
then fewest outstanding tokens), sends it an :class:`~epdserve.serving.protocol.AddRequest`
and streams the worker's outputs back as text. A request with ``n`` choices runs as n
engine requests (ids ``<id>-<i>``, one trace line each) whose outputs are merged.

* **colocated**: one colocated worker produces every token.
* **pd**: a prefill worker returns the first token and a KV descriptor; the first token
  goes to the client at once, then the router hands the descriptor and the first token
  to a decode worker, which streams tokens 2..n.
  With ``--local-prefill-threshold N``, a prompt shorter than N tokens goes to a decode
  worker alone, which prefills it itself (conditional disaggregation: no hand-off).
* **epd**: as pd, but a request's images first go to encode workers (spread over them,
  :class:`~epdserve.serving.protocol.Encode`); once every one has answered
  :class:`~epdserve.serving.protocol.Encoded`, the prefill worker gets the request with
  the descriptors of the embedding frames instead of the image bytes.

A chat request with images (served by a vision-language model) is laid out here: the
images are checked and decoded (:func:`~epdserve.serving.multimodal.parse_chat_images`),
each ``<image>`` placeholder expanded to its tile tokens, and the image bytes travel to
the worker that encodes them (colocated and pd: the worker that prefills).

One background task reads the events socket (a ZeroMQ PULL every worker pushes to) and
puts each output into its request's :class:`asyncio.Queue`; ``Hello`` registers a worker
(the router then connects a PUSH to its command socket) unless
:func:`~epdserve.serving.handshake.refusal` finds it incompatible or its id is held by
another live worker process (it then gets only ``Refused``), ``Stats`` update its state
and the Prometheus gauges. With a token every frame, both ways, is sealed and checked
(:mod:`epdserve.serving.auth`): a frame that fails is logged (rate-limited) and dropped.

Worker states: "up"; "down" once :meth:`Router.mark_dead` is called (by the launcher's
process watch, or here after ``worker_timeout_s`` without any message, heartbeats
included, counted as :meth:`Router._events_loop` says); "refused". A down worker comes
back up by saying Hello again: a restarted process at once; the same process (it was
stopped, or cut off, and its heartbeats resume) after a :class:`~epdserve.serving.protocol.Reset`
that makes it drop everything it held. The requests a worker holds fail at once when it
goes down, except those that have produced nothing yet (queued or prefilling): they are
sent to another live worker of the role; neither kind is resumed when it comes back.

Every request ends in :meth:`Generation.close`, whatever happened (finished, stop string,
client gone, worker error): the worker that still holds it gets ``Abort``, and a prefill
worker whose exported KV was not handed over gets ``ReleaseKV``.

Run alone with ``epdserve router`` (workers started elsewhere connect to ``--events``);
``epdserve serve`` starts it together with its workers.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import pydantic
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epdserve.argtypes import int_at_least
from epdserve.serving import auth
from epdserve.serving import openai_api as api
from epdserve.serving import protocol as P
from epdserve.serving.detokenizer import TextStream
from epdserve.serving.handshake import KV_PEER_ROLES, model_fingerprint, model_kv_shape, refusal
from epdserve.serving.http_guard import add_http_options, uvicorn_config
from epdserve.serving.metrics import RouterMetrics
from epdserve.serving.multimodal import DEFAULT_MAX_IMAGES, ImagePrompter, MediaOptions
from epdserve.trace import RequestTrace

log = logging.getLogger("epdserve.router")

# Tokenizers and Pillow release the GIL while they work, so these threads keep requests'
# preprocessing going beside the event loop. Four, not two (the cores): a request with big
# images may wait in its thread for the process-wide decode budget (multimodal.py), and
# text requests must not queue behind it. The queue bound caps the request bodies held
# waiting for the threads.
PREPROCESS_THREADS = 4
MAX_PREPROCESS_QUEUE = 256
MODE_ROLES = {"colocated": ("colocated",), "pd": ("prefill", "decode"), "epd": ("encode", "prefill", "decode")}
MAX_EVENT_BYTES = 16 << 20
EVENTS_POLL_S = 0.5
STALL_GRACE_S = 0.5  # of one events-loop turn beyond a poll, the most that counts as time it could read
MAX_EVENTS_BATCH = 1000  # frames read in one go before the silence check
TAKEOVER_SILENCE_S = 1.0  # 2 heartbeat intervals: a worker this silent may be replaced by another process
RESET_RETRY_S = 2.0  # how often a down worker that is heard again is sent Reset until it says Hello
MAX_REFUSED = 64  # refused workers listed in /health (the oldest are forgotten)
SYNTHETIC_VISION_NOTE = ("the vision tower has SYNTHETIC (seeded random) weights: the language model is real, "
                         "but what it says about images carries no meaning")  # a worker frame larger than this is dropped by ZeroMQ


class WorkerFailed(Exception):
    """A request that ends with an error, never a hang: a worker rejected it (``status``
    400), failed it (500), was lost with it or none is live to take it (503: worth a retry,
    the launcher restarts workers), or went silent (504)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status

    def api_error(self) -> api.APIError:
        kind = {400: "invalid_request_error", 503: "service_unavailable"}.get(self.status, "internal_server_error")
        return api.APIError(str(self), status=self.status, type=kind, code=self.status)


@dataclass
class WorkerState:
    """What the router knows of one worker. ``outstanding`` maps request ids it holds to
    their token count (prompt + max_tokens); ``last_seen`` is a ``time.monotonic()``,
    ``heard`` the router's read clock (see ``Router._events_loop``) at its last message;
    ``incarnation`` names its process; ``sealer`` seals its commands for that process."""

    worker_id: str
    role: str
    addr: str
    model: str
    sock: zmq.Socket
    kv_layout: dict = field(default_factory=dict)
    cores: list[int] = field(default_factory=list)
    blocks_total: int = 0
    blocks_in_use: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    dead: str | None = None  # why it is considered gone
    outstanding: dict[str, int] = field(default_factory=dict)
    incarnation: str = ""
    sealer: auth.Sealer = field(default_factory=lambda: auth.NO_AUTH.sealer("commands"))
    heard: float = 0.0
    reset_sent: float = -float("inf")  # time.monotonic() of the last Reset

    def send(self, msg) -> None:
        """Queue one command for the worker without blocking.

        Raises:
            WorkerFailed: the worker's command queue is full (it stopped reading).
        """
        try:
            self.sock.send(self.sealer.seal(P.encode(msg)), zmq.NOBLOCK)
        except zmq.Again:
            raise WorkerFailed(f"worker {self.worker_id} is not accepting commands") from None

    def as_json(self, now: float) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "addr": self.addr, "cores": self.cores,
                "state": "down" if self.dead else "up", "reason": self.dead,
                "kv_dtype": self.kv_layout.get("dtype"),
                "blocks_in_use": self.blocks_in_use, "blocks_total": self.blocks_total,
                "num_running": self.num_running, "num_waiting": self.num_waiting,
                "outstanding": len(self.outstanding),
                "outstanding_tokens": sum(self.outstanding.values()),
                "last_seen_s_ago": round(now - self.last_seen, 3)}


class Generation:
    """One request's trip through the workers.

    :meth:`start` picks the first worker and sends it the request (raises
    :class:`~epdserve.serving.openai_api.APIError` 503 if no worker of the role is live);
    :meth:`tokens` yields ``(token_ids, logprobs, finish_reason or None)``; :meth:`close` must be
    called on every outcome and is idempotent. Times are ``time.monotonic()`` seconds.
    """

    def __init__(self, router: "Router", request_id: str, prompt_ids: list[int],
                 sampling: P.SamplingParams, t_arrival: float, images: list[P.ImageRef] = ()):
        self.router = router
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.images = list(images)  # with their bytes
        self.encoders: dict[str, tuple[WorkerState, list[int]]] = {}  # epd: id -> (worker, its images)
        self.embeddings: list[P.EmbeddingRef] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker: WorkerState | None = None  # holds the request now
        self.worker_done = False                 # ... and has finished it
        self.prefill_worker: WorkerState | None = None
        self.decode_worker: WorkerState | None = None
        self.kv_pending = False                  # KV exported, not yet imported by a decode worker
        # See trace(): where the prompt is prefilled.
        self.path = "colocated" if router.mode == "colocated" else (
            "local" if len(prompt_ids) < router.local_prefill_threshold and not images else "disaggregated")
        self.closed = False
        self.t_arrival = t_arrival
        self.t_dispatch: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.output_tokens = 0
        self.cached_tokens = 0  # prompt tokens its first worker found in its prefix cache
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.record = RequestTrace(request_id=request_id, mode=router.mode, path=self.path,
                                   prompt_tokens=len(prompt_ids), max_tokens=sampling.max_tokens)
        self.itls_s: list[float] = []  # gaps between outputs reaching the router (s)

    # -- dispatch
    def _add(self, worker: WorkerState, **kw) -> None:
        if self.images:
            # Only a worker that encodes them gets the bytes; the rest need the hashes.
            encodes_here = worker.role != "decode" and not self.embeddings
            kw["images"] = self.images if encodes_here else [im.model_copy(update={"data": None})
                                                            for im in self.images]
            kw["embeddings"] = self.embeddings
        msg = P.AddRequest(request_id=self.request_id, prompt_token_ids=self.prompt_ids,
                           sampling=self.sampling, **kw)
        self.worker, self.worker_done = worker, False
        worker.outstanding[self.request_id] = len(self.prompt_ids) + self.sampling.max_tokens
        worker.send(msg)

    def start(self) -> None:
        """Send the request to its first worker (colocated, prefill, or decode for a pd
        prompt under the local-prefill threshold), or in epd its images to encode workers
        first (:meth:`tokens` then sends it on to a prefill worker)."""
        router = self.router
        router.requests[self.request_id] = self
        self.t_dispatch = time.monotonic()
        if router.mode == "epd" and self.images:
            self._encode()
            return
        role = {"colocated": "colocated", "disaggregated": "prefill", "local": "decode"}[self.path]
        self._dispatch(router.pick(role))

    def _encode(self) -> None:
        """Deal the images round-robin to the live encode workers, least loaded first; each
        worker answers with one frame for its share."""
        workers = sorted((w for w in self.router.workers.values() if w.role == "encode" and self.router.live(w)),
                         key=lambda w: (len(w.outstanding), w.worker_id))
        if not workers:
            raise api.APIError("no live encode worker", status=503, type="service_unavailable")
        shares = [list(range(i, len(self.images), len(workers))) for i in range(min(len(workers), len(self.images)))]
        for worker, indices in zip(workers, shares):
            self.encoders[worker.worker_id] = (worker, indices)
            worker.outstanding[self.request_id] = 0
            worker.send(P.Encode(request_id=self.request_id, images=[self.images[i] for i in indices]))

    async def _encoded(self) -> None:
        """Wait for every encode worker's :class:`~epdserve.serving.protocol.Encoded` and
        keep their frames (``self.embeddings``) and timings: ``encode_queue_ms`` and
        ``encode_ms`` of the worker that answered last (the critical path),
        ``embedding_bytes`` summed.

        Raises:
            WorkerFailed: an encode worker rejected the images (400), died or went silent.
        """
        waiting = dict(self.encoders)
        silent_since = time.monotonic()
        while waiting:
            msg = await self._poll()
            if msg is None:
                dead = next((w for w, _ in waiting.values() if w.dead), None)
                if dead is not None:
                    raise WorkerFailed(f"encode worker {dead.worker_id} died ({dead.dead})", 503)
                if time.monotonic() - silent_since > self.router.request_timeout_s:
                    raise WorkerFailed(f"no embeddings within {self.router.request_timeout_s:.0f} s", 504)
                continue
            entry = waiting.pop(msg.worker_id, None)
            if entry is None:
                continue
            worker, indices = entry
            if isinstance(msg, P.Error):
                raise WorkerFailed(f"encode worker {worker.worker_id} rejected the images: {msg.message}", msg.status)
            self.embeddings.append(P.EmbeddingRef(images=indices, frame=msg.frame))
            self.record.add("encode", msg.timings)

    def _dispatch(self, worker: WorkerState) -> None:
        if worker.role == "prefill":
            self.prefill_worker = worker
        elif worker.role == "decode":
            self.decode_worker = worker
        self._add(worker)

    async def _first(self) -> P.Output:
        """The first output; if the worker dies before it, the request goes to another
        live worker of the role (nothing reached the client yet, so nothing is repeated).

        Raises:
            WorkerFailed: as :meth:`_next`; 503 if no other worker of the role is live.
        """
        while True:
            try:
                return await self._next()
            except WorkerFailed as exc:
                dead = self.worker
                if not dead.dead:
                    raise
                try:
                    worker = self.router.pick(dead.role)
                except api.APIError:
                    raise WorkerFailed(f"{exc}; no other live {dead.role} worker to retry on", 503) from None
                log.warning("%s: %s; retrying on %s", self.request_id, exc, worker.worker_id)
                # The dead worker may have read, and so deleted, the embedding frames: the
                # next one gets the image bytes and encodes them itself.
                self.embeddings = []
                self._dispatch(worker)

    async def _poll(self):
        """The next message for this request, or None after a second without one (or when
        ``mark_dead`` wakes it up), so that the caller can check its worker."""
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancel (client gone) that lands
        # as a message arrives, and the request then runs on for nobody.
        try:
            async with asyncio.timeout(1.0):
                return await self.queue.get()
        except TimeoutError:
            return None

    async def _next(self) -> P.Output:
        """The next Output of the current worker.

        Raises:
            WorkerFailed: the worker sent Error (with its status), died (503) or went silent (504).
        """
        router, worker = self.router, self.worker
        silent_since = time.monotonic()
        while True:
            msg = await self._poll()
            if msg is None:  # a tick, or mark_dead waking us up
                if worker.dead:
                    raise WorkerFailed(f"worker {worker.worker_id} died ({worker.dead})", 503) from None
                if time.monotonic() - silent_since > router.request_timeout_s:
                    raise WorkerFailed(f"no output from worker {worker.worker_id} for "
                                       f"{router.request_timeout_s:.0f} s", 504) from None
                continue
            if msg.worker_id != worker.worker_id:
                continue  # a late message of a worker we left
            if isinstance(msg, P.Error):
                self.worker_done = True
                verb = "rejected" if msg.status < 500 else "failed"
                raise WorkerFailed(f"worker {worker.worker_id} {verb} the request: {msg.message}", msg.status)
            if msg.finished:
                self.worker_done = True
            self.record.add(worker.role, msg.timings)
            return msg

    async def tokens(self) -> AsyncIterator[tuple[list[int], list | None, str | None]]:
        """Yield each worker output's ``(token_ids, logprobs, finish_reason)`` (logprobs as
        :class:`~epdserve.serving.protocol.Output`'s); the reason is None until the last
        one. Call :meth:`start` first.

        Raises:
            WorkerFailed: see :meth:`_next` and :meth:`_encoded`; also if no decode worker is live.
        """
        if self.encoders:
            await self._encoded()
            try:
                self._dispatch(self.router.pick("prefill"))
            except api.APIError as exc:
                raise WorkerFailed(exc.message, 503) from None
        out = await self._first()
        self.t_first = time.monotonic()
        self.cached_tokens = out.num_cached_tokens  # in pd, the prefill worker's
        if self.path == "disaggregated":
            if out.finished or out.kv is None:
                self.worker = None
                self.router.release_kv(self.prefill_worker, self.request_id)
                if not out.finished:
                    raise WorkerFailed(f"prefill worker {self.prefill_worker.worker_id} sent no KV")
                yield out.token_ids, out.logprobs, out.finish_reason or "stop"
                return
            self.worker, self.kv_pending = None, True
            yield out.token_ids, out.logprobs, None  # the first token reaches the client before the handoff
            try:
                decode = self.router.pick("decode")
            except api.APIError as exc:
                raise WorkerFailed(exc.message, 503) from None
            self.decode_worker = decode
            self._add(decode, kv=out.kv, first_token=out.token_ids[-1])
            self.record.router_hop_ms = (time.monotonic() - self.t_first) * 1000
            out = await self._next()
            # The decode worker imports the KV before its first step, so its first output
            # means the prefill worker's copy is no longer needed.
            self.router.release_kv(self.prefill_worker, self.request_id)
            self.kv_pending = False
        while True:
            yield out.token_ids, out.logprobs, (out.finish_reason or "stop") if out.finished else None
            if out.finished:
                return
            out = await self._next()

    def close(self) -> None:
        """Free the request everywhere: Abort to the worker that still holds it,
        ReleaseKV to a prefill worker whose KV was not handed over. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.t_end = time.monotonic()
        router = self.router
        router.requests.pop(self.request_id, None)
        worker = self.worker
        if worker is not None and not self.worker_done:
            worker.outstanding.pop(self.request_id, None)
            router.send_quietly(worker, P.Abort(request_id=self.request_id))
            if worker is self.prefill_worker:  # its KV may be exported already
                self.kv_pending = True
        if self.kv_pending:
            router.release_kv(self.prefill_worker, self.request_id)
            self.kv_pending = False
        for worker, _ in self.encoders.values():  # an encoding in progress, or a frame never read
            worker.outstanding.pop(self.request_id, None)
            router.release_kv(worker, self.request_id)

    def trace(self) -> RequestTrace:
        """The request's trace record (see :mod:`epdserve.trace` for every stage)."""
        rec = self.record
        rec.output_tokens, rec.finish_reason, rec.error = self.output_tokens, self.finish_reason, self.error
        rec.prefill_worker = self.prefill_worker.worker_id if self.prefill_worker else None
        rec.decode_worker = self.decode_worker.worker_id if self.decode_worker else None
        if self.router.mode == "colocated":
            rec.worker = getattr(self.worker, "worker_id", None)
        if self.encoders:
            rec.encode_workers = sorted(self.encoders)
        if self.images:
            rec.num_images = len(self.images)
        rec.router_queue_ms = _ms(self.t_arrival, self.t_dispatch)
        rec.ttft_ms = _ms(self.t_arrival, self.t_first)
        rec.e2e_ms = _ms(self.t_arrival, self.t_end)
        return rec


def _ms(t0: float | None, t1: float | None) -> float | None:
    return None if t0 is None or t1 is None else round((t1 - t0) * 1000, 3)


class Router:
    """Workers, in-flight requests and the events socket.

    ``mode`` is "colocated" or "pd"; ``model`` a :class:`~epdserve.model.loader.ModelInfo`;
    ``events_addr`` the ZeroMQ address the PULL socket binds (``tcp://...`` or
    ``ipc://...``). A worker silent for ``worker_timeout_s`` seconds is considered dead;
    a request with no output for ``request_timeout_s`` seconds fails. ``auth_token``: if
    set, every frame both ways is sealed with keys derived from it and a worker's Hello
    must carry its HMAC (see :mod:`epdserve.serving.auth`, ``epdserve.serving.handshake``);
    ``internal_encryption`` "curve": TCP sockets use CURVE (needs the token).
    ``local_prefill_threshold`` (pd, tokens): a prompt shorter than this goes straight to a
    decode worker, which prefills it itself; 0 disaggregates every prompt.

    Raises (constructor):
        ValueError: an unknown mode, or CURVE without a token or without libzmq support.
    """

    def __init__(self, mode: str, model, tokenizer, events_addr: str, *, trace_file: str | None = None,
                 worker_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 auth_token: str | None = None, local_prefill_threshold: int = 0,
                 media: MediaOptions = MediaOptions(), internal_encryption: str = "none"):
        if mode not in MODE_ROLES:
            raise ValueError(f"unknown mode {mode!r} (expected one of {', '.join(MODE_ROLES)})")
        self.mode = mode
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.events_addr = events_addr
        self.trace_file = trace_file
        self.worker_timeout_s = worker_timeout_s
        self.request_timeout_s = request_timeout_s
        self.auth_token = auth_token
        self.keyring = auth.Keyring(auth_token, curve=internal_encryption == "curve")
        self._opener = self.keyring.opener("events")
        self._drops = auth.DropLog(log, "dropped a frame on the events socket")
        self._clock = 0.0  # seconds the events loop has been able to read (see _events_loop)
        self.local_prefill_threshold = local_prefill_threshold
        self.fingerprint = model_fingerprint(model.path)
        self.kv_shape = model_kv_shape(model.path)
        # A vision-language model's image layout; None: requests with images get a 400.
        self.images = ImagePrompter(model.path, tokenizer, media) if model.multimodal else None
        self.workers: dict[str, WorkerState] = {}
        self.refused: dict[str, dict] = {}  # worker id -> its /health entry
        self.requests: dict[str, Generation] = {}
        self.metrics = RouterMetrics()
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        self._pull: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))  # see check_text_length
        self._preprocess = concurrent.futures.ThreadPoolExecutor(PREPROCESS_THREADS,
                                                                 thread_name_prefix="epdserve-preprocess")
        self._preprocess_queued = 0

    # -- lifecycle
    def bind(self) -> None:
        """Bind the events socket (idempotent). Raises zmq.ZMQError if the address is taken."""
        if self._pull is None:
            self._pull = self._actx.socket(zmq.PULL)
            self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_BYTES)
            self._pull.setsockopt(zmq.LINGER, 0)
            self.keyring.secure_server(self._pull, self.events_addr)
            self._pull.bind(self.events_addr)

    async def start(self) -> None:
        self.bind()
        self._task = asyncio.create_task(self._events_loop(), name="epdserve-router-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        for w in self.workers.values():
            w.sock.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None

    def shutdown_workers(self) -> None:
        """Ask every live worker to exit (used by the launcher that owns them)."""
        for w in self.workers.values():
            if not w.dead:
                self.send_quietly(w, P.Shutdown())

    # -- workers
    def live(self, w: WorkerState) -> bool:
        return w.dead is None

    def ready(self) -> bool:
        """True when every role the mode needs has a live worker."""
        return all(any(w.role == role and self.live(w) for w in self.workers.values())
                   for role in MODE_ROLES[self.mode])

    def pick(self, role: str) -> WorkerState:
        """The live worker of ``role`` with the fewest outstanding requests (then tokens).

        Raises:
            APIError: 503, no live worker of that role.
        """
        candidates = [w for w in self.workers.values() if w.role == role and self.live(w)]
        if not candidates:
            raise api.APIError(f"no live {role} worker", status=503, type="service_unavailable")
        return min(candidates, key=lambda w: (len(w.outstanding), sum(w.outstanding.values())))

    def mark_dead(self, worker_id: str, reason: str) -> None:
        """Declare a worker down until it says Hello again: it is not picked, and the
        requests it holds are woken at once to fail (or, before their first output, to
        be retried elsewhere)."""
        w = self.workers.get(worker_id)
        if w is None or w.dead:
            return
        w.dead = reason
        log.error("worker %s (%s) is down: %s", worker_id, w.role, reason)
        self.metrics.worker_up.labels(worker_id, w.role).set(0)
        for request_id in w.outstanding:
            gen = self.requests.get(request_id)
            if gen is not None:
                gen.queue.put_nowait(None)
        w.outstanding.clear()

    def send_quietly(self, w: WorkerState, msg) -> None:
        try:
            w.send(msg)
        except WorkerFailed as exc:
            log.warning("could not send %s to %s: %s", msg.type, w.worker_id, exc)

    def release_kv(self, w: WorkerState | None, request_id: str) -> None:
        if w is not None:
            self.send_quietly(w, P.ReleaseKV(request_id=request_id))

    async def _events_loop(self) -> None:
        """Read the workers' frames, and mark down a worker silent for ``worker_timeout_s``.

        Silence is measured on a clock of the time this loop was able to read (``_clock``),
        not the wall clock, so that the router never blames a worker for its own stall: a
        turn of the loop lasts at most one poll (``EVENTS_POLL_S``) plus the handling of what
        it read, and of a longer one (the event loop held by a long synchronous call, the
        process stopped or starved) only ``EVENTS_POLL_S + STALL_GRACE_S`` counts. And every
        frame queued (up to ``MAX_EVENTS_BATCH``) is read before the check, so heartbeats
        that piled up during a stall are heard first. A worker that really stopped is still
        found out after ``worker_timeout_s`` of the router's own running time.
        """
        last_turn = time.monotonic()
        last_check = self._clock
        while True:
            ready = await self._pull.poll(EVENTS_POLL_S * 1000)
            now = time.monotonic()
            self._clock += min(now - last_turn, EVENTS_POLL_S + STALL_GRACE_S)
            last_turn = now
            drained = True
            if ready:
                for _ in range(MAX_EVENTS_BATCH):
                    self._on_frame(await self._pull.recv(), now)
                    if not self._pull.get(zmq.EVENTS) & zmq.POLLIN:
                        break
                else:
                    drained = False  # more queued: read them before judging anyone silent
            if drained and self._clock - last_check >= 1.0:
                last_check = self._clock
                for w in list(self.workers.values()):
                    if not w.dead and self._clock - w.heard > self.worker_timeout_s:
                        self.mark_dead(w.worker_id, f"silent for {self.worker_timeout_s:g} s")

    def _on_frame(self, frame: bytes, now: float) -> None:
        """Check one frame's tag, parse it and act on it; a frame that fails is dropped."""
        try:
            msg = P.decode(self._opener.open(frame))
        except auth.AuthError as exc:
            self._drops(f"it failed authentication: {exc}")
            return
        except P.ProtocolError as exc:
            self._drops(f"bad frame: {exc}")
            return
        try:
            self._on_message(msg, now)
        except Exception:
            log.exception("error handling a worker message")

    def _on_message(self, msg, now: float) -> None:
        if isinstance(msg, P.Hello):
            self._on_hello(msg)
            return
        w = self.workers.get(msg.worker_id)
        if w is None:
            log.debug("message from unknown worker %s ignored", msg.worker_id)
            return
        if isinstance(msg, P.Heartbeat):
            if msg.incarnation != w.incarnation:
                return  # another process claiming this id (one that was replaced, or a token holder)
            if w.dead:
                self._reset(w, now)
        w.last_seen, w.heard = now, self._clock
        if isinstance(msg, P.Heartbeat):
            return
        if isinstance(msg, P.Stats):
            w.blocks_total, w.blocks_in_use = msg.blocks_total, msg.blocks_in_use
            w.num_running, w.num_waiting, w.num_preemptions = msg.num_running, msg.num_waiting, msg.num_preemptions
            self.metrics.set_worker(w.worker_id, w.role, blocks_in_use=msg.blocks_in_use,
                                    blocks_total=msg.blocks_total, num_running=msg.num_running,
                                    num_waiting=msg.num_waiting, num_preemptions=msg.num_preemptions,
                                    prefix_cache_queries=msg.prefix_cache_queries,
                                    prefix_cache_hits=msg.prefix_cache_hits,
                                    mm_cache_queries=msg.mm_cache_queries, mm_cache_hits=msg.mm_cache_hits)
        elif isinstance(msg, (P.Output, P.Error, P.Encoded)):
            if not isinstance(msg, P.Output) or msg.finished or msg.kv is not None:
                w.outstanding.pop(msg.request_id, None)
            gen = self.requests.get(msg.request_id)
            if gen is not None:
                gen.queue.put_nowait(msg)
            elif isinstance(msg, P.Encoded) or (isinstance(msg, P.Output) and msg.kv is not None):
                self.release_kv(w, msg.request_id)  # its client left before the KV (embeddings) arrived

    def _reset(self, w: WorkerState, now: float) -> None:
        """A down worker's own heartbeats resume (it was stopped or cut off, not restarted):
        tell it to drop what it held and say Hello again (at most every RESET_RETRY_S)."""
        if now - w.reset_sent < RESET_RETRY_S:
            return
        w.reset_sent = now
        log.warning("worker %s (%s) is heard again after it went down (%s); resetting it", w.worker_id, w.role,
                    w.dead)
        self.send_quietly(w, P.Reset(incarnation=w.incarnation))

    def _on_hello(self, msg: P.Hello) -> None:
        """Register a worker (new, restarted, or the same process after a Reset), or refuse it.

        Identity: while a worker id is held by a live worker, a Hello for it is taken only
        from the same process (same ``incarnation``: nothing to do) or once that worker has
        been silent for more than ``TAKEOVER_SILENCE_S`` (it died and its successor came up
        before anyone noticed); otherwise it is refused as held. With a token only a token
        holder gets here (the frame's tag was checked). A refused Hello never touches the
        state of the worker registered under its id.
        """
        old = self.workers.get(msg.worker_id)
        if old is not None and not old.dead:
            if msg.incarnation == old.incarnation:
                log.debug("worker %s said hello again", msg.worker_id)
                return
            if self._clock - old.heard <= TAKEOVER_SILENCE_S:
                self._refuse(msg, f"worker id {msg.worker_id} is held by a live worker process (at {old.addr})",
                             held=True)
                return
        peer_role = KV_PEER_ROLES.get(msg.role) if self.mode in ("pd", "epd") else None
        peers = [(w.worker_id, w.kv_layout) for w in self.workers.values()
                 if w.role == peer_role and self.live(w) and w.worker_id != msg.worker_id]
        if msg.role not in MODE_ROLES[self.mode]:
            reason = f"worker {msg.worker_id} has role {msg.role}, a {self.mode} router uses {MODE_ROLES[self.mode]}"
        else:
            kv_shape = self.images.embedding_shape if msg.role == "encode" else self.kv_shape
            reason = refusal(msg, fingerprint=self.fingerprint, kv_shape=kv_shape,
                             auth_token=self.auth_token, peers=peers)
        if reason is not None:
            self._refuse(msg, reason, held=old is not None)
            return
        if old is not None:
            if old.dead is None:
                self.mark_dead(msg.worker_id, "replaced by a new process")
            elif old.incarnation == msg.incarnation:
                log.info("worker %s (%s) is back after a reset", msg.worker_id, msg.role)
            old.sock.close(linger=0)
            if old.role != msg.role:  # the id now names another role
                self.metrics.worker_up.labels(msg.worker_id, old.role).set(0)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        self.keyring.secure_client(sock, msg.addr)
        sock.connect(msg.addr)
        self.refused.pop(msg.worker_id, None)
        self.workers[msg.worker_id] = WorkerState(worker_id=msg.worker_id, role=msg.role, addr=msg.addr,
                                                  model=msg.model, sock=sock, kv_layout=msg.kv_layout,
                                                  cores=msg.cores, blocks_total=msg.blocks_total,
                                                  incarnation=msg.incarnation, heard=self._clock,
                                                  sealer=self.keyring.sealer("commands", msg.incarnation))
        self.metrics.set_worker(msg.worker_id, msg.role, blocks_in_use=0, blocks_total=msg.blocks_total,
                                num_running=0, num_waiting=0, num_preemptions=0)
        self.metrics.worker_up.labels(msg.worker_id, msg.role).set(1)
        log.info("worker %s (%s) is up: hello from %s, cores %s", msg.worker_id, msg.role, msg.addr, msg.cores)

    def _refuse(self, msg: P.Hello, reason: str, held: bool) -> None:
        """Turn ``msg``'s sender away. ``held``: its id names a registered worker, whose state
        (and /health entry) stays as it is; else it is listed in /health as refused.
        ``Refused`` goes to the Hello's address, sealed for the Hello's process alone; without
        a token only when the id is not held (an unauthenticated Hello could name any
        address, a live worker's included)."""
        log.error("refused worker %s (%s) from %s: %s", msg.worker_id, msg.role, msg.addr, reason)
        if not held:
            self.refused.pop(msg.worker_id, None)
            self.refused[msg.worker_id] = {"worker_id": msg.worker_id, "role": msg.role, "addr": msg.addr,
                                           "cores": msg.cores, "state": "refused", "reason": reason,
                                           "kv_dtype": msg.kv_layout.get("dtype"),
                                           "blocks_in_use": 0, "blocks_total": 0, "num_running": 0,
                                           "num_waiting": 0, "outstanding": 0, "outstanding_tokens": 0}
            while len(self.refused) > MAX_REFUSED:
                self.refused.pop(next(iter(self.refused)))
            self.metrics.worker_up.labels(msg.worker_id, msg.role).set(0)
        if held and not self.keyring.enabled:
            return
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)  # deliver Refused, but never block the router for long
        self.keyring.secure_client(sock, msg.addr)
        frame = self.keyring.sealer("commands", msg.incarnation).seal(
            P.encode(P.Refused(reason=reason, incarnation=msg.incarnation)))
        try:
            sock.connect(msg.addr)
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # zmq.Again included
            log.warning("could not send Refused to %s at %s: %s", msg.worker_id, msg.addr, exc)
        finally:
            sock.close()

    # -- requests
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model.name, self.model.source, str(self.model.path)):
            raise api.APIError(f"The model `{model}` does not exist (this server serves "
                               f"`{self.model.name}`).", param="model", code="model_not_found")

    async def prompt(self, body) -> tuple[list[int], list[P.ImageRef]]:
        """Token ids and images (with their bytes) of a chat or completion request.

        The work (chat template, tokenization, reading and decoding images) runs on
        :data:`PREPROCESS_THREADS` threads of its own, never on the event loop: a 10 MB
        prompt takes seconds to tokenize, and the loop also streams every other request's
        tokens and reads the workers' heartbeats. At most :data:`MAX_PREPROCESS_QUEUE`
        requests wait for those threads; more get 503. A text too long for the context
        window by its length alone is refused before any of it (:meth:`check_text_length`).

        Raises:
            APIError: 400, as :meth:`prompt_ids`, images sent to a text model, or bad images
                (see :func:`~epdserve.serving.multimodal.parse_chat_images`); 503 when the
                preprocessing queue is full.
        """
        self.check_text_length(body)
        if self._preprocess_queued >= MAX_PREPROCESS_QUEUE:
            raise api.APIError(f"the server is busy preparing {self._preprocess_queued} requests; retry later",
                               status=503, type="service_unavailable", code=503)
        self._preprocess_queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preprocess, self._prompt, body)
        finally:
            self._preprocess_queued -= 1

    def _prompt(self, body) -> tuple[list[int], list[P.ImageRef]]:
        if not isinstance(body, api.ChatCompletionRequest):
            return self.prompt_ids(body), []
        if self.images is None:
            if not any(m.num_images for m in body.messages):
                return self.prompt_ids(body), []
            raise api.APIError(f"the model `{self.model.name}` takes no images (serve a vision-language model, "
                               "e.g. --model vlm)", param="messages")
        return self.images.prompt([m.model_dump(exclude_none=True) for m in body.messages])

    def check_text_length(self, body) -> None:
        """Refuse, without tokenizing it, a prompt whose text alone is too long: no token
        covers more than ``max_token_chars`` characters (the longest vocabulary entry; a
        byte-level entry's characters are bytes, and a character is at least one byte), so
        N characters are at least N / max_token_chars tokens. Assumes the chat template
        keeps every message's text, as templates do.

        Raises:
            APIError: 400 ``context_length_exceeded`` when that bound is over ``max_model_len``.
        """
        if isinstance(body, api.ChatCompletionRequest):
            chars, param = sum(m.text_chars for m in body.messages), "messages"
        elif isinstance(body.prompt, str):
            chars, param = len(body.prompt), "prompt"
        else:
            return  # token ids: max_tokens() checks their number
        at_least = -(-chars // self.max_token_chars)
        if at_least > self.model.max_model_len:
            raise api.APIError(f"This model's maximum context length is {self.model.max_model_len} tokens. However, "
                               f"your request's {chars} characters are at least {at_least} tokens. Please reduce "
                               "the length of the input.", param=param, code="context_length_exceeded")

    def prompt_ids(self, body) -> list[int]:
        """Token ids of a chat or completion request without images.

        Raises:
            APIError: 400, empty prompt, bad token ids, or a chat template failure.
        """
        if isinstance(body, api.ChatCompletionRequest):
            from epdserve.model.tokenizer import chat_prompt_ids
            try:
                ids = chat_prompt_ids(self.tokenizer, [m.as_template_dict() for m in body.messages])
            except ValueError as exc:
                raise api.APIError(str(exc), param="messages") from None
            param = "messages"
        elif isinstance(body.prompt, str):
            ids = self.tokenizer(body.prompt).input_ids
            param = "prompt"
        else:
            ids, param = list(body.prompt), "prompt"
            self.check_token_ids(ids, "prompt")
        if not ids:
            raise api.APIError("the prompt is empty", param=param)
        return ids

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Raises APIError 400 naming ``param`` if a token id is outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise api.APIError(f"{param}: token id {bad} is out of range [0, {self.vocab_size})", param=param)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as logprobs show it (vLLM decodes it alone too)."""
        return self.tokenizer.decode([token_id])

    def max_tokens(self, body, n_prompt: int) -> int:
        """``max_tokens`` checked against the context window (default: what is left of it).

        Raises:
            APIError: 400 when the prompt plus max_tokens exceed ``max_model_len``.
        """
        limit = self.model.max_model_len
        requested = body.requested_max_tokens()
        if requested is None:
            if n_prompt >= limit:
                raise api.APIError(f"This model's maximum context length is {limit} tokens. However, "
                                   f"your request has {n_prompt} input tokens. Please reduce the "
                                   f"length of the input.", param="messages", code="context_length_exceeded")
            return limit - n_prompt
        if n_prompt + requested > limit:
            raise api.APIError(f"This model's maximum context length is {limit} tokens. However, you "
                               f"requested {n_prompt + requested} tokens ({n_prompt} in the prompt, "
                               f"{requested} in the completion). Please reduce the length of the "
                               f"prompt or completion.", param="max_tokens", code="context_length_exceeded")
        return requested

    def finish(self, gen: Generation) -> None:
        """Record a request that has ended: metrics and the trace line."""
        gen.close()
        rec = gen.trace()
        if gen.error is not None:
            self.metrics.request_failure.inc()
        else:
            self.metrics.finished(rec, gen.itls_s)
        if self.trace_file:
            try:
                with open(self.trace_file, "a") as f:
                    f.write(json.dumps(rec.as_json()) + "\n")
            except OSError as exc:
                log.warning("cannot write trace %s: %s", self.trace_file, exc)

    async def texts(self, gen: Generation, stream: TextStream) -> AsyncIterator[tuple[str, str | None, list]]:
        """Yield ``(new_text, finish_reason or None, logprob entries)``; stops at a stop
        string. The entries, ``(token id, logprob, [(top id, logprob), ...])``, are those
        of the tokens since the last yield (text held back carries its tokens' over)."""
        last, entries = None, []
        async for ids, logprobs, finish in gen.tokens():
            now = time.monotonic()
            if last is not None:
                gen.itls_s.append(now - last)
            last = now
            gen.output_tokens += len(ids)
            if logprobs is not None:
                entries += [(t, lp, top) for t, (lp, top) in zip(ids, logprobs)]
            delta = stream.add(ids)
            if stream.stopped:
                gen.finish_reason = "stop"
                yield delta, "stop", entries
                return
            if finish is not None:
                gen.finish_reason = finish
                yield delta + stream.finish(), finish, entries
                return
            if delta:
                yield delta, None, entries
                entries = []

    async def merged(self, choices: list["Choice"]) -> AsyncIterator[tuple[int, str, str | None, list]]:
        """Yield ``(choice index, new_text, finish_reason or None, logprob entries)`` of
        every choice (see :meth:`texts`) as they come. Closing it cancels every choice's
        reader; the caller still closes the generations.

        Raises:
            WorkerFailed: any choice failed (the others are then abandoned).
        """
        if len(choices) == 1:  # the usual case: no task and queue hop per token
            async for item in self.texts(choices[0].gen, choices[0].text):
                yield (0, *item)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for item in self.texts(choice.gen, choice.text):
                    queue.put_nowait((choice.index, *item))
                queue.put_nowait(None)
            except Exception as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            for _ in tasks:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class Choice:
    """One of a request's ``n`` choices: its generation, text stream, and (if logprobs
    were asked) the formatter of its logprobs; ``parts``/``entries`` collect a
    non-streamed answer."""

    index: int
    gen: Generation
    text: TextStream
    logprobs: api.LogprobsFormatter | None
    parts: list[str] = field(default_factory=list)
    entries: list = field(default_factory=list)

    def logprobs_object(self, entries: list) -> dict | None:
        return None if self.logprobs is None else self.logprobs(entries)


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that notices a client going away even while no token
    flows, and always closes its generator (whose ``finally`` frees the request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.create_task(stream()), asyncio.create_task(listen())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()
        for exc in results:
            if isinstance(exc, Exception) and not isinstance(exc, OSError):
                log.error("stream failed: %s: %s", type(exc).__name__, exc)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(router: Router) -> FastAPI:
    """The FastAPI app of ``router``; its lifespan starts and stops the events task."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="epdserve", lifespan=lifespan)
    app.router.route_class = api.BoundedJSONRoute  # a body of millions of JSON values: 413, unparsed
    app.state.router = router
    api.install_error_handlers(app, on_bad_request=router.metrics.bad_request.inc)

    async def serve(http_request: Request, body, kind: str):
        t_arrival = time.monotonic()
        router.check_model(body.model)
        prompt_ids, images = await router.prompt(body)
        max_tokens = router.max_tokens(body, len(prompt_ids))
        if body.min_tokens > max_tokens:  # vLLM's rule
            raise api.APIError(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({max_tokens})",
                               param="min_tokens")
        router.check_token_ids(body.stop_token_ids, "stop_token_ids")
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        choices = [Choice(i, Generation(router, rid if body.n == 1 else f"{rid}-{i}", prompt_ids,
                                        sampling_params(body, max_tokens, i), t_arrival, images),
                          TextStream(router.tokenizer, prompt_ids, body.stop_list, body.include_stop_str_in_output),
                          None if body.num_logprobs is None else api.LogprobsFormatter(kind, router.token_text))
                   for i in range(body.n)]
        try:
            for c in choices:
                c.gen.start()
        except Exception as exc:
            # Whatever failed, no choice may stay registered (held by a worker, counted in
            # flight) without a client: every one is finished here.
            _failed(choices, exc)
            for c in choices:
                router.finish(c.gen)
            if isinstance(exc, WorkerFailed):
                raise exc.api_error() from None
            raise
        if body.stream:
            return SSEResponse(stream_events(rid, choices, body, kind))
        return await complete(http_request, rid, choices, kind)

    def sampling_params(body, max_tokens: int, i: int) -> P.SamplingParams:
        """Choice ``i``'s sampling settings. As vLLM's parallel sampling, choice i of a
        seeded request draws with seed + i (wrapped into int64), so choices differ but repeat.

        Raises:
            APIError: 400, a value the engine refuses (its message names the field).
        """
        seed = None if body.seed is None else (body.seed + i + 2**63) % 2**64 - 2**63
        try:
            return P.SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                seed=seed, ignore_eos=body.ignore_eos, stop_token_ids=body.stop_token_ids,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens, logprobs=body.num_logprobs)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(map(str, err["loc"])) or None
            raise api.APIError(f"{field}: {err['msg']}" if field else err["msg"], param=field) from None

    def _failed(choices: list[Choice], exc: Exception) -> None:
        for c in choices:
            if c.gen.finish_reason is None:  # abandoned with the failed one
                c.gen.error = str(exc)

    async def stream_events(rid: str, choices: list[Choice], body, kind: str):
        model, created, usage = router.model.name, api.now_s(), body.include_usage
        try:
            if kind == "chat":
                for c in choices:
                    yield api.sse(api.chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                                 include_usage=usage, index=c.index))
            async with contextlib.aclosing(router.merged(choices)) as events:
                async for i, delta, finish, entries in events:
                    lp = choices[i].logprobs_object(entries)
                    if kind == "chat":
                        chunk = api.chat_chunk(rid, model, created, {"content": delta} if delta else {},
                                               finish, include_usage=usage, index=i, logprobs=lp)
                    else:
                        chunk = api.completion_chunk(rid, model, created, delta, finish, include_usage=usage,
                                                     index=i, logprobs=lp)
                    yield api.sse(chunk)
            if usage:
                obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                yield api.sse(api.usage_chunk(rid, model, created, obj, len(choices[0].gen.prompt_ids),
                                              sum(c.gen.output_tokens for c in choices),
                                              choices[0].gen.cached_tokens))
            yield api.SSE_DONE
        except WorkerFailed as exc:
            _failed(choices, exc)
            err = exc.api_error()
            yield api.sse(api.error_body(err.message, type=err.type, code=err.status))
            yield api.SSE_DONE
        finally:
            for c in choices:
                router.finish(c.gen)

    async def complete(http_request: Request, rid: str, choices: list[Choice], kind: str):
        async def collect():
            async with contextlib.aclosing(router.merged(choices)) as events:
                async for i, delta, _, entries in events:
                    choices[i].parts.append(delta)
                    choices[i].entries += entries

        task = asyncio.create_task(collect())
        watch = asyncio.create_task(_wait_disconnect(http_request))
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                return Response(status_code=499)  # the client is gone; nobody reads this
            try:
                task.result()
            except WorkerFailed as exc:
                _failed(choices, exc)
                raise exc.api_error() from None
        finally:
            for t in (task, watch):
                t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
            for c in choices:
                router.finish(c.gen)
        build, choice = ((api.chat_completion, api.chat_choice) if kind == "chat"
                         else (api.text_completion, api.completion_choice))
        return JSONResponse(build(rid, router.model.name, api.now_s(),
                                  [choice(c.index, "".join(c.parts), c.gen.finish_reason,
                                          c.logprobs_object(c.entries)) for c in choices],
                                  len(choices[0].gen.prompt_ids), sum(c.gen.output_tokens for c in choices),
                                  choices[0].gen.cached_tokens))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        return await serve(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        return await serve(request, body, "completion")

    @app.get("/v1/models")
    async def models():
        m = router.model
        card = {"id": m.name, "object": "model", "created": api.now_s(), "owned_by": "epdserve", "root": m.source,
                "max_model_len": m.max_model_len, "input_modalities": ["text", "image"] if m.multimodal else ["text"]}
        if m.synthetic_vision:
            card["synthetic_vision"] = True
            card["note"] = SYNTHETIC_VISION_NOTE
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        now = time.monotonic()
        ok = router.ready()
        body = {"status": "ok" if ok else "unavailable", "mode": router.mode, "model": router.model.name,
                "needs": list(MODE_ROLES[router.mode]), "requests_in_flight": len(router.requests),
                "workers": [w.as_json(now) for w in router.workers.values()] + list(router.refused.values())}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    return app


# ------------------------------------------------------------------------ sub-command

def add_router_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``epdserve router`` and ``epdserve serve``."""
    parser.add_argument("--mode", choices=list(MODE_ROLES), default="colocated",
                        help="colocated: one worker role; pd: prefill and decode workers; epd: encode, prefill "
                             "and decode workers (a vision-language model)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF directory (default: SmolLM2-135M); 'vlm': the default vision-language "
                             "model (SmolLM2-135M with a SmolVLM vision tower of SYNTHETIC weights)")
    parser.add_argument("--limit-images-per-prompt", type=int_at_least(0), default=DEFAULT_MAX_IMAGES,
                        help="most images one request may carry (vLLM's --limit-mm-per-prompt)")
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="directory image_url file paths may be read from (default: none)")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="fetch http(s) image URLs (lets clients make the server fetch any reachable address)")
    parser.add_argument("--trace-file", default=None, help="append one JSON line per finished request")
    parser.add_argument("--worker-timeout", type=float, default=5.0,
                        help="seconds without any message (workers send a heartbeat every 0.5 s) "
                             "after which a worker counts as down; counted only while the router can read, so "
                             "a stall of the router is not blamed on its workers")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds without output after which a request fails")
    parser.add_argument("--local-prefill-threshold", type=int_at_least(0), default=0,
                        help="pd: prompts shorter than this many tokens are prefilled by a decode worker "
                             "itself, without a KV hand-off (0: never)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_http_options(parser)
    auth.add_arguments(parser, "shared secret that seals every frame between the router and its workers "
                               "(default: $EPDSERVE_AUTH_TOKEN; serve: a random one)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_options(parser)
    parser.add_argument("--events", default="tcp://127.0.0.1:5557",
                        help="ZeroMQ address the router binds for worker events (workers' --router)")


def build_router(args: argparse.Namespace, events_addr: str) -> Router:
    """Resolve the model, load its tokenizer and make a Router from parsed options.

    Raises:
        ModelLoadError: the model cannot be found or read.
    """
    from epdserve.model.loader import ModelLoadError, resolve_model
    from epdserve.model.tokenizer import load_tokenizer

    model = resolve_model(args.model)
    if args.mode == "epd" and not model.multimodal:
        raise ModelLoadError(f"--mode epd needs a vision-language model (e.g. --model vlm), not {model.name}")
    media = MediaOptions(max_images=args.limit_images_per_prompt, allowed_local_dir=args.allowed_local_media_path,
                         allow_remote=args.allow_remote_images)
    return Router(args.mode, model, load_tokenizer(model.path), events_addr, trace_file=args.trace_file,
                  worker_timeout_s=args.worker_timeout, request_timeout_s=args.request_timeout,
                  auth_token=args.auth_token, local_prefill_threshold=args.local_prefill_threshold, media=media,
                  internal_encryption=args.internal_encryption)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(args: argparse.Namespace) -> int:
    """``epdserve router``: serve HTTP; workers started elsewhere connect to ``--events``.
    Returns 2 on a bad option or model (``--events`` on TCP needs a token unless
    ``--allow-unauthenticated``)."""
    import uvicorn

    from epdserve.model.loader import ModelLoadError

    setup_logging(args.log_level)
    error = auth.options_error(args, [args.events] if args.events.startswith("tcp://") else [])
    if error is not None:
        print(f"epdserve router: error: {error}", file=sys.stderr)
        return 2
    try:
        router = build_router(args, args.events)
    except ModelLoadError as exc:
        print(f"epdserve router: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(router)
    log.info("router (%s, %s) on http://%s:%d; waiting for workers on %s (frames %s%s)", args.mode,
             router.model.name, args.host, args.port, args.events,
             "sealed" if router.keyring.enabled else "NOT authenticated", ", CURVE" if router.keyring.curve else "")
    uvicorn.Server(uvicorn_config(app, args)).run()
    return 0
