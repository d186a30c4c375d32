"""Discrete-event simulation of a deployment serving a trace (SimPy).

The simulated engine follows epdserve's scheduler (engine/scheduler.py, vLLM v1 policy):
each step gives every running sequence its next tokens (decodes one, a chunked prefill its
next chunk), then admits waiting sequences while ``max_num_seqs`` and
``max_num_batched_tokens`` allow; without chunked prefill a prompt is prefilled whole.
A step lasts what the platform's step model says, its decodes slowed as served ones are,
more so while every other device of the deployment is busy (``Platform.served_step_ms``). The router sends a request to the
worker of the role with the fewest outstanding requests, then tokens (prompt +
max_tokens), as serving/router.py does. In PD the first token is streamed when the
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

Images (serving/worker.py, serving/encode_worker.py): a request's image tokens count in
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
and prefill on core 0).

Requests are :class:`~epdserve.bench.workload.Request` (a bench trace); the simulator
reads their offsets, token counts and images, and their texts only for shared starts. Each request yields the
client's view as a :class:`~epdserve.bench.client.RequestRecord`
(so :func:`epdserve.bench.metrics.compute` gives TTFT/ITL/TPOT/E2EL and goodput exactly as
for a measured run) and a server-side stage record with the keys the router's trace uses
(``prefill_queue_ms``, ``prefill_ms``, ``kv_transfer_ms``, ``decode_queue_ms``,
``encode_queue_ms``, ``encode_ms``, ``embedding_bytes``, ``embedding_transfer_ms``, ...).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass

import simpy

from epdserve.bench.client import RequestRecord
from epdserve.bench.workload import Request
from epdserve.plan.costmodel import Platform, StepModel

ROLES = ("colocated", "prefill", "decode", "encode")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its role and how many devices (cores or GPUs, tensor parallel) it has;
    workers with the same non-empty ``share`` tag run on the same devices."""

    role: str
    devices: int = 1
    share: str = ""


@dataclass(frozen=True)
class Deployment:
    """A named set of workers, e.g. ``2p1d`` = two prefill and one decode worker,
    ``1e1p1d`` = one encode, one prefill and one decode worker."""

    name: str
    workers: tuple[WorkerSpec, ...]

    @property
    def devices(self) -> int:
        """Devices in use, shared ones counted once."""
        shared = {w.share: w.devices for w in self.workers if w.share}
        return sum(w.devices for w in self.workers if not w.share) + sum(shared.values())

    @property
    def mode(self) -> str:
        roles = {w.role for w in self.workers}
        return "epd" if "encode" in roles else "pd" if "prefill" in roles else "colocated"


@dataclass(frozen=True)
class EngineLimits:
    """Scheduler settings of every simulated worker (as ``epdserve serve`` takes them)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = True
    block_size: int = 16


class _Seq:
    """A request inside the simulation; times are simulated seconds."""

    __slots__ = ("index", "req", "prompt", "computed", "tokens", "arrival", "enqueued",
                 "stages", "first_step", "ctx_base", "encoding", "encoded")

    def __init__(self, index: int, req: Request, prompt: int, arrival: float):
        self.index, self.req, self.prompt = index, req, prompt
        self.computed = 0
        self.tokens: list[float] = []  # server time of each generated token
        self.arrival = arrival
        self.enqueued = arrival
        self.stages: dict[str, float] = {}
        self.first_step = 0
        self.ctx_base = 0
        self.encoding = 0       # EPD: encode workers still holding some of its images
        self.encoded = False    # EPD: its embeddings wait in encode workers' frames


# Texts are looked up by their first characters: a shared start shorter than this is less
# than a block of tokens, which the prefix cache would not hit anyway (~4 characters a token).
TEXT_KEY_CHARS = 32


def _common_start(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share from the start (bisection on C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _kv_blocks(role: str, prompt: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request holds on a worker of ``role``: its prompt on a prefill worker,
    its prompt and ``max_tokens`` elsewhere (a prefix-cache hit's shared blocks counted as
    its own)."""
    return -(-(prompt if role == "prefill" else prompt + max_tokens) // block_size)


def _image_key(image: dict) -> tuple[int, int, int]:
    """Equal size and seed are equal bytes (bench/images.py): one embedding cache entry."""
    return image["width"], image["height"], image["seed"]


class _Devices:
    """The devices of one worker, or of several (``shared``): a piece of work of ``ms``
    takes ``ms`` alone and runs at 1/n speed while n pieces are in progress (processor
    sharing)."""

    def __init__(self, env: simpy.Environment, shared: bool):
        self.env, self.shared = env, shared
        self.left: dict[simpy.Event, float] = {}  # work in progress: its done event -> ms left
        self.since = 0.0
        self.timer: simpy.Event | None = None
        self.busy = 0  # pieces of work in progress

    def run(self, ms: float) -> simpy.Event:
        """An event that fires once ``ms`` of work is done here."""
        self.busy += 1
        if self.shared:
            self._advance()
            done = self.env.event()
            self.left[done] = ms
            self._schedule()
        else:
            done = self.env.timeout(ms / 1e3)
        done.callbacks.append(self._release)  # before the waiting process resumes
        return done

    def _release(self, done: simpy.Event) -> None:
        self.busy -= 1

    def _advance(self) -> None:
        if self.left:
            share = (self.env.now - self.since) * 1e3 / len(self.left)
            for event in self.left:
                self.left[event] -= share
        self.since = self.env.now

    def _schedule(self) -> None:
        if self.left:
            self.timer = self.env.timeout(max(min(self.left.values()), 0.0) * len(self.left) / 1e3)
            self.timer.callbacks.append(self._tick)

    def _tick(self, timer: simpy.Event) -> None:
        if timer is not self.timer:
            return  # superseded by work that started since
        self._advance()
        for event, left in list(self.left.items()):
            if left <= 1e-6:  # float rounding of the clock
                del self.left[event]
                event.succeed()
        self._schedule()


class _Worker:
    def __init__(self, sim: "_Simulation", spec: WorkerSpec, step: StepModel, devices: _Devices):
        self.sim, self.role, self.step_model, self.devices = sim, spec.role, step, devices
        self.size = spec.devices
        self.images: set[tuple[int, int, int]] = set()  # encoded here (embedding cache)
        self.inbox: deque[_Seq] = deque()
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.num_decode = 0
        self.decode_context = 0          # Σ cached tokens of the decoding sequences
        self._bases: list[int] = []      # max-heap (negated) of their ctx_base ...
        self._gone: Counter = Counter()  # ... with lazy deletion of finished ones
        self.finish_at: dict[int, list[_Seq]] = {}
        self.step_times: list[float] = []
        self.held = 0                    # outstanding requests ...
        self.outstanding = 0             # ... and their prompt + max_tokens
        capacity = sim.platform.kv_capacity_tokens
        # KV blocks not reserved by a request here (None: unbounded)
        self.free_blocks = None if capacity is None else capacity(spec.devices) // sim.limits.block_size
        self.import_bytes = 0.0          # KV to copy in during the next step
        self.prefix_cached = False       # the template's full blocks are in its prefix cache
        self.texts: dict[str, list[str]] = {}  # texts prefilled here, by their first TEXT_KEY_CHARS
        self.wake = sim.env.event()

    def submit(self, seq: _Seq) -> None:
        seq.enqueued = self.sim.env.now
        self.inbox.append(seq)
        self.held += 1
        self.outstanding += seq.prompt + seq.req.max_tokens
        if not self.wake.triggered:
            self.wake.succeed()

    def _take_in(self, s: _Seq):
        """Before it can be scheduled, a request with images gets their embeddings: fetched
        from the encode workers' frames (EPD) or encoded here (a prefill-capable worker)."""
        images, platform = s.req.images, self.sim.platform
        if images and self.role != "decode" and s.encoded:
            nbytes = sum(platform.images.embedding_bytes((im["width"], im["height"])) for im in images)
            start = self.sim.env.now
            yield self.devices.run(platform.kv_link.transfer_ms(nbytes))
            s.stages.update(embedding_bytes=float(nbytes), embedding_transfer_ms=(self.sim.env.now - start) * 1e3)
        elif images and self.role != "decode":
            start = self.sim.env.now
            yield self.devices.run(self.sim.encode_ms(self, images))
            s.stages.update(encode_queue_ms=(start - s.enqueued) * 1e3, encode_ms=(self.sim.env.now - start) * 1e3)
        if images and self.role != "decode":
            s.enqueued = self.sim.env.now  # encoding or fetching is its own stage, not queue time
        self.waiting.append(s)

    def run(self):
        env, limits = self.sim.env, self.sim.limits
        while True:
            while self.inbox:  # every command that has arrived, before the next step
                yield from self._take_in(self.inbox.popleft())
            if not (self.waiting or self.prefilling or self.num_decode):
                self.wake = env.event()
                yield self.wake
                continue
            k = len(self.step_times)
            chunks, joining = self._schedule(limits)
            if not (chunks or joining or self.num_decode):  # waiting for KV blocks to come free
                self.wake = env.event()
                yield self.wake
                continue
            extra_ms = 0.0
            if self.import_bytes and self.sim.platform.kv_import_gbs:
                extra_ms += self.import_bytes / (self.sim.platform.kv_import_gbs * 1e9) * 1e3
            self.import_bytes = 0.0
            ms = self.sim.platform.served_step_ms(self.step_model, [(n, s.computed) for s, n in chunks],
                                                  self.num_decode + len(joining),
                                                  self.decode_context + sum(s.prompt for s in joining),
                                                  max([self._max_context(k)] + [s.prompt for s in joining]),
                                                  self.sim.contended(self.devices))
            for s in joining:
                self._start_decode(s, k, s.prompt)
            for s, _ in chunks:
                s.stages.setdefault("first_scheduled", env.now)
            yield self.devices.run(ms + extra_ms)
            self._finish_step(k, chunks)

    def _schedule(self, limits: EngineLimits) -> tuple[list[tuple[_Seq, int]], list[_Seq]]:
        """Prefill chunks ``(seq, tokens)`` and the decode-role arrivals joining this step."""
        budget = limits.max_num_batched_tokens - self.num_decode
        chunks: list[tuple[_Seq, int]] = []
        for s in self.prefilling:
            if budget <= 0:
                break
            n = min(s.prompt - s.computed, budget)
            chunks.append((s, n))
            budget -= n
        joining: list[_Seq] = []
        running = len(self.prefilling) + self.num_decode
        while self.waiting and budget > 0 and running < limits.max_num_seqs:
            s = self.waiting[0]
            if self.free_blocks is not None and self.kv_blocks(s) > self.free_blocks:
                break
            if s.computed < s.prompt:  # a prompt to compute here, less its prefix-cache hit
                s.computed = self._prefix_hit(s)
            n = 1 if s.computed == s.prompt else s.prompt - s.computed  # KV arrived: one token
            if n > budget and not limits.enable_chunked_prefill:
                break
            n = min(n, budget)
            self.waiting.popleft()
            self.reserve(s, 1)
            s.stages[f"{self.role}_queue_ms"] = (self.sim.env.now - s.enqueued) * 1e3
            if s.computed == s.prompt:
                joining.append(s)
                self.import_bytes += s.prompt * self.sim.platform.kv_bytes_per_token
            else:
                self.prefilling.append(s)
                chunks.append((s, n))
            running += 1
            budget -= n
        return chunks, joining

    def kv_blocks(self, s: _Seq) -> int:
        return _kv_blocks(self.role, s.prompt, s.req.max_tokens, self.sim.limits.block_size)

    def reserve(self, s: _Seq, sign: int) -> None:
        """Take (``sign`` 1) or give back (-1) the KV blocks of ``s``; giving back wakes
        the loop, which may wait for them."""
        if self.free_blocks is None:
            return
        self.free_blocks -= sign * self.kv_blocks(s)
        if sign < 0 and not self.wake.triggered:
            self.wake.succeed()

    def _prefix_hit(self, s: _Seq) -> int:
        """Tokens of ``s``'s prompt found in this worker's prefix cache at admission, in full
        blocks: the template's once they are cached here, through the longest start its text
        shares with a text prefilled here; never the last token (its logits must be
        computed; engine/prefix_cache.py, vLLM's rule)."""
        if not self.prefix_cached:
            return 0
        hit = self.sim.cached_prefix
        text = s.req.prompt
        if text and not s.req.images:
            shared = max((_common_start(text, t) for t in self.texts.get(text[:TEXT_KEY_CHARS], ())), default=0)
            if shared:
                hit = self.sim.platform.template_prefix_tokens + shared * s.req.prompt_tokens // len(text)
        size = self.sim.limits.block_size
        return min(hit // size * size, (s.prompt - 1) // size * size)

    def _max_context(self, k: int) -> int:
        """The longest cached context among the decoding sequences at step ``k`` (0 if none)."""
        while self._bases and self._gone[-self._bases[0]]:
            self._gone[-heapq.heappop(self._bases)] -= 1
        return k - self._bases[0] if self._bases else 0

    def _start_decode(self, s: _Seq, k: int, context: int) -> None:
        """``s`` decodes from step ``k`` on with ``context`` cached tokens, until done."""
        remaining = s.req.max_tokens - len(s.tokens)
        s.first_step, s.ctx_base = k, context - k
        heapq.heappush(self._bases, -s.ctx_base)
        self.num_decode += 1
        self.decode_context += context
        self.finish_at.setdefault(k + remaining - 1, []).append(s)

    def _finish_step(self, k: int, chunks: list[tuple[_Seq, int]]) -> None:
        now = self.sim.env.now
        self.step_times.append(now)
        self.decode_context += self.num_decode
        for s in self.finish_at.pop(k, []):
            s.tokens.extend(self.step_times[s.first_step:k + 1])
            self.num_decode -= 1
            self.decode_context -= s.ctx_base + k + 1
            self._gone[s.ctx_base] += 1
            self._done(s, now)
        for s, n in chunks:
            s.computed += n
            # The engine caches a block once all its tokens have K/V (after the step).
            self.prefix_cached |= s.computed >= self.sim.cached_prefix
            if s.computed < s.prompt:
                continue
            self.prefilling.remove(s)
            if self.sim.limits.enable_prefix_caching and not s.req.images:
                self.texts.setdefault(s.req.prompt[:TEXT_KEY_CHARS], []).append(s.req.prompt)
            s.tokens.append(now)
            s.stages["prefill_ms"] = (now - s.stages.pop("first_scheduled")) * 1e3
            if len(s.tokens) >= s.req.max_tokens:
                self._done(s, now)
            elif self.role == "prefill":
                self.held -= 1
                self.outstanding -= s.prompt + s.req.max_tokens
                self.sim.env.process(self.sim.hand_off(s, self))
            else:
                self._start_decode(s, k + 1, s.prompt)

    def _done(self, s: _Seq, now: float) -> None:
        self.held -= 1
        self.outstanding -= s.prompt + s.req.max_tokens
        self.reserve(s, -1)
        if self.role != "prefill":
            first = s.tokens[0]
            s.stages["decode_ms"] = (now - first) * 1e3
        self.sim.finish(s)


class _EncodeWorker:
    """An EPD encode worker: each call encodes every share of images pending here."""

    def __init__(self, sim: "_Simulation", spec: WorkerSpec, devices: _Devices):
        self.sim, self.role, self.devices, self.size = sim, spec.role, devices, spec.devices
        self.images: set[tuple[int, int, int]] = set()  # encoded here (embedding cache)
        self.pending: list[tuple[_Seq, tuple[dict, ...], float]] = []  # with the time it came
        self.outstanding = 0  # requests with images here
        self.wake = sim.env.event()

    def submit(self, seq: _Seq, images: tuple[dict, ...]) -> None:
        self.pending.append((seq, images, self.sim.env.now))
        self.outstanding += 1
        if not self.wake.triggered:
            self.wake.succeed()

    def run(self):
        env = self.sim.env
        while True:
            if not self.pending:
                self.wake = env.event()
                yield self.wake
                continue
            batch, self.pending = self.pending, []
            start = env.now
            yield self.devices.run(self.sim.encode_ms(self, [im for _, images, _ in batch for im in images]))
            for s, _, queued in batch:
                # As the router keeps them: the timings of the encode worker that answered last.
                s.stages.update(encode_queue_ms=(start - queued) * 1e3, encode_ms=(env.now - start) * 1e3)
                self.outstanding -= 1
                s.encoding -= 1
                if s.encoding == 0:
                    s.encoded = True
                    self.sim.pick("prefill").submit(s)


class _Simulation:
    def __init__(self, deployment: Deployment, platform: Platform, limits: EngineLimits):
        self.env = simpy.Environment()
        self.platform, self.limits, self.deployment = platform, limits, deployment
        # The template tokens every prompt starts with, in full blocks: what a hit can reuse.
        self.cached_prefix = platform.template_prefix_tokens // limits.block_size * limits.block_size \
            if limits.enable_prefix_caching else 0
        shared: dict[str, _Devices] = {}
        self.workers, self.encoders, self.devices = [], [], []
        for w in deployment.workers:
            devices = shared.setdefault(w.share, _Devices(self.env, True)) if w.share else _Devices(self.env, False)
            if devices not in self.devices:
                self.devices.append(devices)
            if w.role == "encode":
                self.encoders.append(_EncodeWorker(self, w, devices))
            else:
                self.workers.append(_Worker(self, w, platform.step(w.devices), devices))
        self.finished: list[_Seq] = []
        for w in self.workers + self.encoders:
            self.env.process(w.run())

    def contended(self, devices: _Devices) -> bool:
        """Whether every device of the deployment but ``devices`` is busy: no core is left
        for the router and the client, which then take theirs from the workers."""
        others = [d for d in self.devices if d is not devices]
        return bool(others) and all(d.busy for d in others)

    def pick(self, role: str) -> _Worker:
        return min((w for w in self.workers if w.role == role), key=lambda w: (w.held, w.outstanding))

    def encode_ms(self, worker: "_Worker | _EncodeWorker", images: list[dict]) -> float:
        """One encode call of ``images`` on ``worker``: the tiles of the distinct images
        it has not encoded before, which it then has."""
        cost = self.platform.images
        new = {_image_key(im) for im in images} - worker.images
        worker.images |= new
        return cost.encode_ms(sum(cost.tiles((w, h)) for w, h, _ in new), worker.size) * self.platform.time_scale

    def arrive(self, index: int, req: Request):
        yield self.env.timeout(req.offset_s)
        seq = _Seq(index, req, prompt_tokens(self.platform, req), self.env.now)
        yield self.env.timeout(self.platform.router_ms / 1e3)
        if self.encoders and req.images:
            # serving/router.py: least outstanding first, image i to the (i mod n)-th of them.
            order = sorted(self.encoders, key=lambda w: w.outstanding)
            shares = [(w, req.images[i::len(order)]) for i, w in enumerate(order) if req.images[i::len(order)]]
            seq.encoding = len(shares)
            for w, images in shares:
                w.submit(seq, images)
        else:
            self.pick("colocated" if self.deployment.mode == "colocated" else "prefill").submit(seq)

    def hand_off(self, s: _Seq, source: _Worker):
        ms = self.platform.kv_link.transfer_ms(s.prompt * self.platform.kv_bytes_per_token)
        s.stages["kv_bytes"] = float(s.prompt * self.platform.kv_bytes_per_token)
        s.stages["kv_transfer_ms"] = ms
        yield self.env.timeout(ms / 1e3)
        source.reserve(s, -1)
        s.computed = s.prompt
        self.pick("decode").submit(s)

    def finish(self, s: _Seq) -> None:
        self.finished.append(s)


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
        need = max(_kv_blocks(w.role, prompt_tokens(platform, r), r.max_tokens, limits.block_size) for r in requests)
        if need > blocks:
            raise KVCapacityError(f"deployment {deployment.name}: a {w.role} worker of {w.devices} "
                                  f"device(s) holds {blocks} KV blocks of {limits.block_size} tokens, "
                                  f"the largest request needs {need}")


def _check(deployment: Deployment, platform: Platform, requests: list[Request], limits: EngineLimits) -> None:
    roles = {w.role for w in deployment.workers}
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
    for i, r in enumerate(requests):
        if r.images and platform.images is None:
            raise ValueError(f"request {i} has images but {platform.name} takes none "
                             f"(a text-only model, or a calibration without encode timings)")
        if r.prompt_tokens < 1 or r.max_tokens < 1:
            raise ValueError(f"request {i}: prompt_tokens and max_tokens must be >= 1")
        if prompt_tokens(platform, r) > limits.max_num_batched_tokens and not limits.enable_chunked_prefill:
            raise ValueError(f"request {i}: a {prompt_tokens(platform, r)}-token prompt exceeds "
                             f"max_num_batched_tokens={limits.max_num_batched_tokens} "
                             f"without chunked prefill")
    _check_kv_capacity(deployment, platform, requests, limits)


def simulate(deployment: Deployment, platform: Platform, requests: list[Request],
             limits: EngineLimits = EngineLimits()) -> tuple[list[RequestRecord], list[dict]]:
    """Serve ``requests`` with ``deployment`` on ``platform``; return the client records
    (trace order; times in seconds as the bench client measures them, ``router_ms`` added
    on the way in) and the server stage records (ms; ``kv_bytes`` and ``embedding_bytes``
    in bytes).

    Raises:
        KVCapacityError: a worker whose KV cache cannot hold the largest request.
        ValueError: a deployment without a complete set of roles or with devices shared
            by workers of different sizes, an empty request, images for a platform that
            takes none, or a prompt that can never be scheduled with these limits.
    """
    _check(deployment, platform, requests, limits)
    sim = _Simulation(deployment, platform, limits)
    for i, req in enumerate(requests):
        sim.env.process(sim.arrive(i, req))
    sim.env.run()
    records, stages = [None] * len(requests), [None] * len(requests)
    for s in sim.finished:
        times = [t - s.arrival for t in s.tokens]
        records[s.index] = RequestRecord(
            index=s.index, kind=s.req.kind, offset_s=s.req.offset_s, max_tokens=s.req.max_tokens,
            expected_prompt_tokens=s.req.prompt_tokens, start_s=s.arrival, chunk_times_s=times,
            last_chunk_s=times[-1], end_s=s.arrival + times[-1], usage_prompt_tokens=s.prompt,
            usage_completion_tokens=len(times), request_id=str(s.index), success=True)
        stages[s.index] = {"request_id": str(s.index), "prompt_tokens": s.prompt,
                           "output_tokens": len(times), "ttft_ms": times[0] * 1e3,
                           "e2e_ms": times[-1] * 1e3, **s.stages}
    return records, stages
