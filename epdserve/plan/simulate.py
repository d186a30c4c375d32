"""Discrete-event simulation (SimPy) of a deployment serving a trace, following epdserve's
scheduler, router and KV hand-off; what it models is in docs/planner.md, "What it models".
Workers are in :mod:`epdserve.plan.sim_worker`, elastic ones in :mod:`epdserve.plan.sim_elastic`."""

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
    """``devices``: cores or GPUs; ``tp`` ranks of one device each (1: one process on all);
    equal ``share`` tags run on the same devices, equal ``overlap`` tags partly share theirs
    (round-robin placement), each slowed by ``contended_slowdown`` while another is busy."""

    role: str
    devices: int = 1
    share: str = ""
    tp: int = 1
    overlap: str = ""


@dataclass(frozen=True)
class Deployment:
    """``elastic``: the engine workers change role live under that controller; ``workers``
    are their starting roles."""

    name: str
    workers: tuple[WorkerSpec, ...]
    elastic: ElasticConfig | None = None

    @property
    def devices(self) -> int:
        """Shared devices counted once; an overlap group as many as its largest worker has."""
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
    """serve's scheduler defaults; ``max_num_batched_tokens`` None: each worker's own step
    budget, as an engine sets it."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    block_size: int = 16


class Simulation:
    """A deployment's workers on one SimPy clock."""

    def __init__(self, deployment: Deployment, platform: Platform, limits: EngineLimits):
        self.env = simpy.Environment()
        self.platform, self.limits, self.deployment = platform, limits, deployment
        # The template's full blocks every prompt starts with: what a hit can reuse.
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
        # Requests in flight as each arrival found them: how replay tells a settling queue.
        self.in_flight_seen: dict[int, int] = {}
        self._awaited: set[int] = set()  # see until_finished
        self._all_finished: simpy.Event | None = None
        for w in self.workers + self.encoders:
            self.env.process(w.run())
        self.controller = Controller(self, deployment.elastic) if deployment.elastic else None

    def add(self, requests: list[Request], first_index: int = 0) -> None:
        """Arrivals at ``offset_s`` from the simulation's start; none may lie in its past."""
        for i, req in enumerate(requests, first_index):
            self.env.process(self.arrive(i, req))

    def results(self, indices) -> tuple[list[RequestRecord | None], list[RequestTrace | None]]:
        """(client records, server traces) of ``indices``; None: not finished yet."""
        done = {s.index: s for s in self.finished}
        records = [_client_record(done[i]) if i in done else None for i in indices]
        traces = [_trace(done[i], self.platform.router_ms) if i in done else None for i in indices]
        return records, traces

    def contended(self, devices: Devices) -> bool:
        """Every other device busy: the router and client take their CPU from the workers."""
        others = [d for d in self.devices if d is not devices]
        return bool(others) and all(d.busy for d in others)

    def pick(self, role: str, exclude: Worker | None = None) -> Worker:
        """Fewest outstanding requests, then tokens, as the router's registry; elastic: a decode
        stage falls back to a colocated worker. Raises ValueError when no worker has ``role``."""
        candidates = [w for w in self.workers if w.role == role and w is not exclude]
        if not candidates and self.controller and role == "decode":
            candidates = [w for w in self.workers if w.role == "colocated" and w is not exclude]
        if not candidates:
            raise ValueError(f"deployment {self.deployment.name}: no {role} worker to route to")
        return min(candidates, key=lambda w: (w.held, w.outstanding))

    def encode_ms(self, worker: "Worker | EncodeWorker", images: list[dict]) -> float:
        """Only the images ``worker`` has not encoded before (its embedding cache, taken as
        unbounded: 256 MB holds ~1,700 default-model images)."""
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
            # least outstanding first, image i to the (i mod n)-th
            order = sorted(self.encoders, key=lambda w: w.outstanding)
            shares = [(w, req.images[i::len(order)]) for i, w in enumerate(order) if req.images[i::len(order)]]
            seq.encoding = len(shares)
            for w, images in shares:
                w.submit(seq, images)
        else:
            self.pick("colocated" if seq.path == "colocated" else "prefill").submit(seq)

    def hand_off(self, s: Seq, source: Worker):
        ms = self.platform.kv_link.transfer_ms(s.prompt * self.platform.kv_bytes_per_token)
        # The simulated prefill worker exports nothing before its first token: it is all fetch.
        s.stages.update(kv_bytes=float(s.prompt * self.platform.kv_bytes_per_token), kv_export_ms=0.0,
                        kv_fetch_ms=ms)
        yield self.env.timeout(ms / 1e3)
        source.reserve(s, -1)
        s.computed = s.prompt
        # Never back to the worker that prefilled it (elastic: it may be colocated by now).
        self.pick("decode", exclude=source).submit(s, "decode")

    def until_finished(self, indices: range) -> simpy.Event:
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
    """Text, chat template and image tokens."""
    return req.prompt_tokens + platform.template_tokens + sum(
        platform.images.prompt_tokens((im["width"], im["height"])) for im in req.images)


class KVCapacityError(ValueError):
    """A worker cannot hold a request's KV (or any: the weights fill it); another
    deployment of the same devices may."""


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
    """Raises KVCapacityError, ValueError as :func:`simulate`."""
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
    """(client records in trace order, in s with ``router_ms`` added; server traces in ms and
    bytes); request ids are trace indices.

    Raises KVCapacityError (a worker too small for the largest request) and ValueError (an
    incomplete set of roles, shared devices of unequal sizes, an empty request, images on a
    platform without an image model, a prompt these limits never schedule)."""
    return serve(deployment, platform, requests, limits).results(range(len(requests)))


def serve(deployment: Deployment, platform: Platform, requests: list[Request],
          limits: EngineLimits = EngineLimits()) -> Simulation:
    """Run until every request finished; ``controller`` holds an elastic deployment's decisions."""
    check(deployment, platform, requests, limits)
    sim = Simulation(deployment, platform, limits)
    sim.add(requests)
    sim.env.run(until=sim.until_finished(range(len(requests))))  # an elastic controller ticks on
    return sim


def _client_record(s: Seq) -> RequestRecord:
    times = [t - s.arrival for t in s.tokens]
    return RequestRecord(
        index=s.index, kind=s.req.kind, offset_s=s.req.offset_s, max_tokens=s.req.max_tokens,
        expected_prompt_tokens=s.req.prompt_tokens, start_s=s.arrival, chunk_times_s=times,
        last_chunk_s=times[-1], end_s=s.arrival + times[-1], usage_prompt_tokens=s.prompt,
        usage_completion_tokens=len(times), request_id=str(s.index), success=True)


def _trace(s: Seq, router_ms: float) -> RequestTrace:
    """Its mode is its path's, an elastic request's too, as the router writes it."""
    return RequestTrace(request_id=str(s.index), mode=s.path,
                        path="colocated" if s.path == "colocated" else "disaggregated",
                        prompt_tokens=s.prompt, output_tokens=len(s.tokens), max_tokens=s.req.max_tokens,
                        num_images=len(s.req.images) or None, router_queue_ms=router_ms,
                        ttft_ms=(s.tokens[0] - s.arrival) * 1e3, e2e_ms=(s.tokens[-1] - s.arrival) * 1e3,
                        **s.stages)
