"""Discrete-event simulation of a deployment serving a trace (SimPy).

The simulated engine follows epdserve's scheduler (engine/scheduler.py, vLLM v1 policy):
each step gives every running sequence its next tokens (decodes one, a chunked prefill its
next chunk), then admits waiting sequences while ``max_num_seqs`` and
``max_num_batched_tokens`` allow; without chunked prefill a prompt is prefilled whole.
A step lasts what the platform's step model says, its prefills and decodes slowed as
served ones are, its decodes more so while every other device of the deployment is busy
(``Platform.served_step_ms``). The router sends a request to the worker of the role with the fewest outstanding requests, then tokens (prompt +
max_tokens), as serving/router/registry.py picks. In PD the first token is streamed when the
prefill worker samples it; the KV then crosses ``kv_link`` and the decode worker copies
it in during its next step (``kv_import_gbs``). KV memory (``Platform.kv_capacity_tokens``
per worker, in blocks of ``block_size``): a request is admitted only while the blocks of its
prompt plus ``max_tokens`` are free (a prefill worker: of its prompt, held until the KV has
crossed), and waits in line otherwise; first come, first served. The engine allocates
blocks as tokens come and preempts when out of them; reserving the peak at admission admits
no more than it could finish without preemption (a bench trace's ``max_tokens`` is its
output length: the peak is known).
Prefix caching (on in ``epdserve serve``, as in vLLM v1): every chat prompt starts with the
chat template's system turn (``Platform.template_prefix_tokens``), so once a worker has
prefilled one prompt, the next ones find those full blocks cached and compute only the rest
(a prefill chunk of prompt − hit new tokens over hit cached ones). A text-only prompt whose
text starts as one this worker prefilled before (a shared document or system prompt) also
finds that shared start: its characters in tokens at the request's own tokens per character,
in full blocks. The cache is taken as never evicting.

Images (serving/worker/engine_worker.py, serving/worker/encode_worker.py): a request's image tokens count in
its prompt. In colocated and PD the worker that prefills encodes a request's images when it
takes the request in, before its next step, blocking that step (so every running decode
waits too). In EPD the router spreads a request's images over the encode workers (least
outstanding requests first, image i to the i-th, round robin); an encode worker encodes
everything pending in one call; once every share is done the prefill worker with the least
outstanding work takes the request in, fetching the embeddings over ``kv_link`` (blocking its
loop, as it maps the frames), then queues it for prefill. Every worker that encodes keeps
the images it encoded (the embedding cache by content hash; its 256 MB default holds
about 1,700 default-model images, so it is taken as unbounded): a repeated image costs
nothing. Workers whose :class:`WorkerSpec` ``share`` tags match run on the same devices
and split them while more than one is busy (processor sharing, as the OS time-slices
processes pinned to the same cores: the launcher's EPD placement on 2 cores puts encode
and prefill on core 0). A tensor-parallel worker (``WorkerSpec.tp``) steps by the platform's
model of its ranks (``Platform.worker_step``: on a calibrated CPU its TP fit); workers whose
``overlap`` tags match share some of their cores (the launcher's round-robin placement of more
ranks than cores) and run on their own devices, every step slowed by ``contended_slowdown``
while another of them is busy (docs/planner-validation.md, "Tensor-parallel configurations").

Requests are :class:`~epdserve.bench.workload.Request` (a bench trace); the simulator
reads their offsets, token counts and images, and their texts only for shared starts. Each request yields the
client's view as a :class:`~epdserve.bench.client.RequestRecord`
(so :func:`epdserve.bench.metrics.compute` gives TTFT/ITL/TPOT/E2EL and goodput exactly as
for a measured run) and the server's view as a :class:`~epdserve.trace.RequestTrace` (the
router's trace record, as :mod:`epdserve.trace` defines its stages): router queue
(``router_ms``), worker queues, ``prefill_ms``, ``decode_ms``, image encoding, and the KV and
embedding crossings as fetches (``kv_fetch_ms``, ``embedding_fetch_ms``: the simulation
puts the whole crossing there) with the decode worker's copy-in as ``kv_import_ms``.
The workers themselves are in :mod:`epdserve.plan.sim_worker`; an elastic deployment's
(workers that change role live, with ``serve --elastic``'s controller in the loop) in
:mod:`epdserve.plan.sim_elastic`.
"""

from __future__ import annotations

from dataclasses import dataclass

import simpy

from epdserve.bench.client import RequestRecord
from epdserve.bench.workload import Request
from epdserve.plan.costmodel import Platform
from epdserve.plan.sim_elastic import Controller, ElasticConfig, ElasticWorker
from epdserve.plan.sim_worker import Devices, EncodeWorker, Seq, Worker, image_key, request_kv_blocks
from epdserve.trace import RequestTrace
from epdserve.serving.deployment import ROLES



@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its role, how many devices (cores or GPUs) it has and in how many
    tensor-parallel ranks (``tp``, processes of one device each: 1 is one process on all
    of them; :meth:`Platform.worker_step <epdserve.plan.costmodel.Platform.worker_step>`);
    workers with the same non-empty ``share`` tag run on the same devices; workers with the
    same non-empty ``overlap`` tag partly share theirs (the launcher's round-robin placement
    of more ranks than cores): each runs on its own, slowed by the platform's
    ``contended_slowdown`` while another of them is busy."""

    role: str
    devices: int = 1
    share: str = ""
    tp: int = 1
    overlap: str = ""


@dataclass(frozen=True)
class Deployment:
    """A named set of workers, e.g. ``2p1d`` = two prefill and one decode worker,
    ``1e1p1d`` = one encode, one prefill and one decode worker. ``elastic``: the engine
    workers change role live under the controller it configures (``serve --elastic``,
    :mod:`epdserve.plan.sim_elastic`); ``workers`` are then their starting roles."""

    name: str
    workers: tuple[WorkerSpec, ...]
    elastic: ElasticConfig | None = None

    @property
    def devices(self) -> int:
        """Devices in use, shared ones counted once, those of workers that partly share
        theirs as many as the largest of them has (round-robin placement wraps within them)."""
        shared = {w.share: w.devices for w in self.workers if w.share}
        overlap: dict[str, int] = {}
        for w in self.workers:
            if w.overlap and not w.share:
                overlap[w.overlap] = max(overlap.get(w.overlap, 0), w.devices)
        return (sum(w.devices for w in self.workers if not (w.share or w.overlap)) + sum(shared.values())
                + sum(overlap.values()))

    @property
    def mode(self) -> str:
        if self.elastic:
            return "elastic"
        roles = {w.role for w in self.workers}
        return "epd" if "encode" in roles else "pd" if "prefill" in roles else "colocated"


@dataclass(frozen=True)
class EngineLimits:
    """Scheduler settings of every simulated worker (as ``epdserve serve`` takes them, with
    serve's defaults: ``engine/scheduler.py``'s). ``max_num_batched_tokens`` None: each
    worker's own, as an engine sets it (``model/step_budget.py``, from its step model)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16


class Simulation:
    """A deployment's workers on one SimPy clock: arrivals, the router's picks, the KV
    hand-off, and the requests finished so far."""

    def __init__(self, deployment: Deployment, platform: Platform, limits: EngineLimits):
        self.env = simpy.Environment()
        self.platform, self.limits, self.deployment = platform, limits, deployment
        # The template tokens every prompt starts with, in full blocks: what a hit can reuse.
        self.cached_prefix = platform.template_prefix_tokens // limits.block_size * limits.block_size \
            if limits.enable_prefix_caching else 0
        shared: dict[str, Devices] = {}
        overlapping: dict[str, list[Devices]] = {}
        self.workers, self.encoders, self.devices = [], [], []
        for w in deployment.workers:
            devices = shared.setdefault(w.share, Devices(self.env, True)) if w.share else Devices(self.env, False)
            if devices not in self.devices:
                self.devices.append(devices)
            if w.role == "encode":
                self.encoders.append(EncodeWorker(self, w, devices))
            else:
                cls = ElasticWorker if deployment.elastic else Worker
                self.workers.append(cls(self, w, platform.worker_step(w.devices, w.tp), devices))
            if w.overlap:
                overlapping.setdefault(w.overlap, []).append(devices)
        for group in overlapping.values():
            for d in group:
                d.overlaps = [o for o in group if o is not d]
        self.finished: list[Seq] = []
        # Requests in flight (arrived, not finished) as each arrival found them, by index:
        # how :mod:`epdserve.plan.replay` tells a queue that settles from one that grows.
        self.in_flight_seen: dict[int, int] = {}
        self._awaited: set[int] = set()  # see until_finished
        self._all_finished: simpy.Event | None = None
        for w in self.workers + self.encoders:
            self.env.process(w.run())
        # serve --elastic's controller: samples the simulated signals, switches roles.
        self.controller = Controller(self, deployment.elastic) if deployment.elastic else None

    def add(self, requests: list[Request], first_index: int = 0) -> None:
        """Schedule the arrivals of ``requests`` (indices from ``first_index``) at their
        ``offset_s``, counted from the start of the simulation; none may lie in its past."""
        for i, req in enumerate(requests, first_index):
            self.env.process(self.arrive(i, req))

    def results(self, indices) -> tuple[list[RequestRecord | None], list[RequestTrace | None]]:
        """The client record and server trace of each request of ``indices`` (None: not
        finished yet)."""
        done = {s.index: s for s in self.finished}
        records = [_client_record(done[i]) if i in done else None for i in indices]
        traces = [_trace(done[i], self.platform.router_ms) if i in done else None for i in indices]
        return records, traces

    def contended(self, devices: Devices) -> bool:
        """Whether every device of the deployment but ``devices`` is busy: no core is left
        for the router and the client, which then take theirs from the workers."""
        others = [d for d in self.devices if d is not devices]
        return bool(others) and all(d.busy for d in others)

    def pick(self, role: str, exclude: Worker | None = None) -> Worker:
        """The worker of ``role`` (never ``exclude``) with the fewest outstanding requests,
        then tokens (serving/router/registry.py); elastic: a decode stage goes to a colocated
        worker when no decode worker is live (the registry's ``ELASTIC_FALLBACK``).

        Raises:
            ValueError: no worker of ``role`` (nor of its fallback).
        """
        candidates = [w for w in self.workers if w.role == role and w is not exclude]
        if not candidates and self.controller and role == "decode":
            candidates = [w for w in self.workers if w.role == "colocated" and w is not exclude]
        if not candidates:
            raise ValueError(f"deployment {self.deployment.name}: no {role} worker to route to")
        return min(candidates, key=lambda w: (w.held, w.outstanding))

    def encode_ms(self, worker: "Worker | EncodeWorker", images: list[dict]) -> float:
        """One encode call of ``images`` on ``worker``: the tiles of the distinct images
        it has not encoded before, which it then has."""
        cost = self.platform.images
        new = {image_key(im) for im in images} - worker.images
        worker.images |= new
        return cost.encode_ms(sum(cost.tiles((w, h)) for w, h, _ in new), worker.size) * self.platform.time_scale

    def arrive(self, index: int, req: Request):
        yield self.env.timeout(req.offset_s - self.env.now)
        self.in_flight_seen[index] = len(self.in_flight_seen) - len(self.finished)  # arrived before it, not finished
        seq = Seq(index, req, prompt_tokens(self.platform, req), self.env.now)
        yield self.env.timeout(self.platform.router_ms / 1e3)
        # The path by the roles live when the router sends it on (elastic: its serving_path).
        seq.path = self.controller.path() if self.controller else self.deployment.mode
        if self.controller:
            self.controller.arrival(seq)
        if self.encoders and req.images:
            # the router (serving/router/registry.py): least outstanding first, image i to the (i mod n)-th of them.
            order = sorted(self.encoders, key=lambda w: w.outstanding)
            shares = [(w, req.images[i::len(order)]) for i, w in enumerate(order) if req.images[i::len(order)]]
            seq.encoding = len(shares)
            for w, images in shares:
                w.submit(seq, images)
        else:
            self.pick("colocated" if seq.path == "colocated" else "prefill").submit(seq)

    def hand_off(self, s: Seq, source: Worker):
        ms = self.platform.kv_link.transfer_ms(s.prompt * self.platform.kv_bytes_per_token)
        # The whole crossing comes after the first token: the trace's fetch (the simulated
        # prefill worker exports nothing before its first token).
        s.stages.update(kv_bytes=float(s.prompt * self.platform.kv_bytes_per_token), kv_export_ms=0.0,
                        kv_fetch_ms=ms)
        yield self.env.timeout(ms / 1e3)
        source.reserve(s, -1)
        s.computed = s.prompt
        # Never back to the worker that prefilled it (elastic: it may be colocated by now).
        self.pick("decode", exclude=source).submit(s, "decode")

    def until_finished(self, indices: range) -> simpy.Event:
        """An event that fires once every request of ``indices`` has finished."""
        self._awaited = set(indices) - {s.index for s in self.finished}
        self._all_finished = self.env.event()
        if not self._awaited:
            self._all_finished.succeed()
        return self._all_finished

    def finish(self, s: Seq) -> None:
        self.finished.append(s)
        if self.controller:
            self.controller.finished(s)
        if s.index in self._awaited:
            self._awaited.discard(s.index)
            if not self._awaited:
                self._all_finished.succeed()


def prompt_tokens(platform: Platform, req: Request) -> int:
    """The prompt a request's text, the chat template and its images make."""
    return req.prompt_tokens + platform.template_tokens + sum(
        platform.images.prompt_tokens((im["width"], im["height"])) for im in req.images)


class KVCapacityError(ValueError):
    """A worker of the deployment cannot hold a request's KV (or any KV: the weights fill
    its memory); another deployment of the same devices may."""


def _check_kv_capacity(deployment: Deployment, platform: Platform, requests: list[Request],
                       limits: EngineLimits) -> None:
    if platform.kv_capacity_tokens is None or not requests:
        return
    for w in deployment.workers:
        if w.role == "encode":
            continue
        blocks = platform.kv_capacity_tokens(w.devices) // limits.block_size
        need = max(request_kv_blocks(w.role, prompt_tokens(platform, r), r.max_tokens, limits.block_size) for r in requests)
        if need > blocks:
            raise KVCapacityError(f"deployment {deployment.name}: a {w.role} worker of {w.devices} "
                                  f"device(s) holds {blocks} KV blocks of {limits.block_size} tokens, "
                                  f"the largest request needs {need}")


def check(deployment: Deployment, platform: Platform, requests: list[Request], limits: EngineLimits) -> None:
    """That ``deployment`` can serve ``requests`` on ``platform`` (the errors of :func:`simulate`).

    Raises:
        KVCapacityError, ValueError: as :func:`simulate`.
    """
    roles = {w.role for w in deployment.workers}
    if deployment.elastic and (len(deployment.workers) < 2 or roles - {"colocated", "prefill", "decode"}):
        raise ValueError(f"deployment {deployment.name}: an elastic deployment needs 2 or more engine workers "
                         f"and no encode worker (got {len(deployment.workers)} workers, {sorted(roles)})")
    if not deployment.workers or roles - set(ROLES) or ("prefill" in roles) != ("decode" in roles) \
            or ("colocated" in roles and "prefill" in roles) or ("encode" in roles and "prefill" not in roles):
        raise ValueError(f"deployment {deployment.name}: needs colocated workers, or prefill "
                         f"and decode workers, optionally with encode workers (got {sorted(roles)})")
    sizes: dict[str, set[int]] = {}
    for w in deployment.workers:
        if w.share:
            sizes.setdefault(w.share, set()).add(w.devices)
    if any(len(s) > 1 for s in sizes.values()):
        raise ValueError(f"deployment {deployment.name}: workers sharing devices must have as many")
    for w in deployment.workers:
        if w.role != "encode":
            platform.worker_step(w.devices, w.tp)  # raises where the platform has no model of it
    for i, r in enumerate(requests):
        if r.images and platform.images is None:
            raise ValueError(f"request {i} has images but {platform.name} takes none "
                             f"(a text-only model, or a calibration without encode timings)")
        if r.prompt_tokens < 1 or r.max_tokens < 1:
            raise ValueError(f"request {i}: prompt_tokens and max_tokens must be >= 1")
        if not limits.enable_chunked_prefill and prompt_tokens(platform, r) > limits.max_num_batched_tokens:
            raise ValueError(f"request {i}: a {prompt_tokens(platform, r)}-token prompt exceeds "
                             f"max_num_batched_tokens={limits.max_num_batched_tokens} "
                             f"without chunked prefill")
    _check_kv_capacity(deployment, platform, requests, limits)


def simulate(deployment: Deployment, platform: Platform, requests: list[Request],
             limits: EngineLimits = EngineLimits()) -> tuple[list[RequestRecord], list[RequestTrace]]:
    """Serve ``requests`` with ``deployment`` on ``platform``; return the client records
    (trace order; times in seconds as the bench client measures them, ``router_ms`` added
    on the way in) and the server's :class:`~epdserve.trace.RequestTrace` of each (ms;
    ``kv_bytes`` and ``embedding_bytes`` in bytes; request ids are the trace indices).

    Raises:
        KVCapacityError: a worker whose KV cache cannot hold the largest request.
        ValueError: a deployment without a complete set of roles or with devices shared
            by workers of different sizes, an empty request, images for a platform that
            takes none, or a prompt that can never be scheduled with these limits.
    """
    return serve(deployment, platform, requests, limits).results(range(len(requests)))


def serve(deployment: Deployment, platform: Platform, requests: list[Request],
          limits: EngineLimits = EngineLimits()) -> Simulation:
    """The simulation of :func:`simulate`, run until every request of ``requests`` has
    finished (its ``controller`` holds an elastic deployment's decisions).

    Raises:
        KVCapacityError, ValueError: as :func:`simulate`.
    """
    check(deployment, platform, requests, limits)
    sim = Simulation(deployment, platform, limits)
    sim.add(requests)
    sim.env.run(until=sim.until_finished(range(len(requests))))  # an elastic controller ticks on
    return sim


def _client_record(s: Seq) -> RequestRecord:
    """What the bench client would have recorded of a finished request."""
    times = [t - s.arrival for t in s.tokens]
    return RequestRecord(
        index=s.index, kind=s.req.kind, offset_s=s.req.offset_s, max_tokens=s.req.max_tokens,
        expected_prompt_tokens=s.req.prompt_tokens, start_s=s.arrival, chunk_times_s=times,
        last_chunk_s=times[-1], end_s=s.arrival + times[-1], usage_prompt_tokens=s.prompt,
        usage_completion_tokens=len(times), request_id=str(s.index), success=True)


def _trace(s: Seq, router_ms: float) -> RequestTrace:
    """The router's trace of a finished request: its stages as the simulation timed them;
    its mode is its path's (an elastic request's too, as the router writes it)."""
    return RequestTrace(request_id=str(s.index), mode=s.path,
                        path="colocated" if s.path == "colocated" else "disaggregated",
                        prompt_tokens=s.prompt, output_tokens=len(s.tokens), max_tokens=s.req.max_tokens,
                        num_images=len(s.req.images) or None, router_queue_ms=router_ms,
                        ttft_ms=(s.tokens[0] - s.arrival) * 1e3, e2e_ms=(s.tokens[-1] - s.arrival) * 1e3,
                        **s.stages)
