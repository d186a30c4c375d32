"""The simulated workers of :mod:`epdserve.plan.simulate`: a request in the simulation, devices
with processor sharing, an engine worker's scheduler loop with KV blocks and prefix cache, and
an EPD encode worker. Times are simulated seconds; ``Seq.stages`` are ms, named as
:class:`~epdserve.trace.RequestTrace` attributes."""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, deque
from typing import TYPE_CHECKING

import simpy

from epdserve.bench.workload import Request
from epdserve.engine.scheduler import SchedulerConfig
from epdserve.model import step_budget
from epdserve.plan.costmodel import StepModel

if TYPE_CHECKING:  # simulate imports this module
    from epdserve.plan.simulate import EngineLimits, Simulation, WorkerSpec


class Seq:
    __slots__ = ("index", "req", "prompt", "computed", "tokens", "arrival", "enqueued",
                 "stages", "first_scheduled", "first_step", "ctx_base", "encoding", "encoded", "role", "path")

    def __init__(self, index: int, req: Request, prompt: int, arrival: float):
        self.index, self.req, self.prompt = index, req, prompt
        self.computed = 0
        self.tokens: list[float] = []
        self.arrival = arrival
        self.enqueued = arrival
        self.stages: dict[str, float] = {}
        self.first_scheduled: float | None = None
        self.first_step = 0
        self.ctx_base = 0
        self.encoding = 0       # EPD: encode workers still holding some of its images
        self.encoded = False    # EPD: its embeddings wait in encode workers' frames
        # The role its worker took it in (elastic: kept through a switch's drain); its path.
        self.role = ""
        self.path = ""


# A shared start shorter than this is under a block of tokens (~4 characters a token).
TEXT_KEY_CHARS = 32


def common_start(a: str, b: str) -> int:
    """Bisection on C-speed slice compares."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def longest_shared_start(text: str, texts: list[str]) -> int:
    """``texts`` sorted: the best match is a neighbour, so two comparisons."""
    i = bisect.bisect_left(texts, text)
    return max((common_start(text, t) for t in texts[max(i - 1, 0):i + 1]), default=0)


def request_kv_blocks(role: str, prompt: int, max_tokens: int, block_size: int) -> int:
    """Prompt on a prefill worker, prompt + ``max_tokens`` elsewhere (a prefix hit's shared
    blocks counted as its own)."""
    return -(-(prompt if role == "prefill" else prompt + max_tokens) // block_size)


def image_key(image: dict) -> tuple[int, int, int]:
    """Equal size and seed are equal bytes: one embedding cache entry."""
    return image["width"], image["height"], image["seed"]


class Devices:
    """One worker's devices, or several workers' (``shared``): n pieces of work in progress each run
    at 1/n speed (processor sharing)."""

    def __init__(self, env: simpy.Environment, shared: bool):
        self.env, self.shared = env, shared
        self.left: dict[simpy.Event, float] = {}  # done event -> ms left
        self.since = 0.0
        self.timer: simpy.Event | None = None
        self.busy = 0
        # Devices of other workers that partly share these cores (WorkerSpec.overlap).
        self.overlaps: list[Devices] = []

    def run(self, ms: float) -> simpy.Event:
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

    def overlapped(self) -> bool:
        """A worker that partly shares these cores is busy."""
        return any(d.busy for d in self.overlaps)

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


class Worker:
    def __init__(self, sim: Simulation, spec: WorkerSpec, step: StepModel, devices: Devices):
        self.sim, self.role, self.step_model, self.devices = sim, spec.role, step, devices
        self.size, self.tp = spec.devices, spec.tp
        self.images: set[tuple[int, int, int]] = set()  # embedding cache
        self.inbox: deque[Seq] = deque()
        self.waiting: deque[Seq] = deque()
        self.prefilling: list[Seq] = []
        self.num_decode = 0
        self.decode_context = 0          # Σ cached tokens of the decoding sequences
        self._bases: list[int] = []      # max-heap (negated) of their ctx_base ...
        self._gone: Counter = Counter()  # ... with lazy deletion of finished ones
        self.finish_at: dict[int, list[Seq]] = {}
        self.step_times: list[float] = []
        self.held = 0
        self.outstanding = 0             # Σ prompt + max_tokens
        capacity = sim.platform.kv_capacity_tokens
        # KV blocks not reserved here (None: unbounded)
        self.free_blocks = None if capacity is None else capacity(spec.devices) // sim.limits.block_size
        self.budget = sim.limits.max_num_batched_tokens or self._step_budget()
        self.import_bytes = 0.0          # KV to copy in during the next step
        self.prefix_cached = False       # the template's full blocks
        self.texts: dict[str, list[str]] = {}  # prefilled here, sorted, by first TEXT_KEY_CHARS
        self.wake = sim.env.event()

    def submit(self, seq: Seq, role: str = "") -> None:
        """``role``: default this worker's role now (a decode stage sent to a colocated worker is
        taken in as ``decode``)."""
        seq.role = role or self.role
        seq.enqueued = self.sim.env.now
        self.inbox.append(seq)
        self.held += 1
        self.outstanding += seq.prompt + seq.req.max_tokens
        if not self.wake.triggered:
            self.wake.succeed()

    def _take_in(self, s: Seq):
        """Embeddings first: fetched from encode workers (EPD) or encoded here."""
        images, platform = s.req.images, self.sim.platform
        if images and s.role != "decode" and s.encoded:
            nbytes = sum(platform.images.embedding_bytes((im["width"], im["height"])) for im in images)
            start = self.sim.env.now
            yield self.devices.run(platform.kv_link.transfer_ms(nbytes))
            # The whole crossing: the simulated encode worker's frame costs nothing to write.
            s.stages.update(embedding_bytes=float(nbytes), embedding_export_ms=0.0,
                            embedding_fetch_ms=(self.sim.env.now - start) * 1e3)
        elif images and s.role != "decode":
            start = self.sim.env.now
            yield self.devices.run(self.sim.encode_ms(self, images))
            s.stages.update(encode_queue_ms=(start - s.enqueued) * 1e3, encode_ms=(self.sim.env.now - start) * 1e3)
        if images and s.role != "decode":
            s.enqueued = self.sim.env.now  # encoding or fetching is its own stage, not queue time
        self.waiting.append(s)

    def run(self):
        env, limits = self.sim.env, self.sim.limits
        while True:
            while self.inbox:  # every command arrived, before the next step
                yield from self._take_in(self.inbox.popleft())
            if not (self.waiting or self.prefilling or self.num_decode):
                self.wake = env.event()
                yield self.wake
                continue
            k = len(self.step_times)
            chunks, joining = self._schedule(limits)
            if not (chunks or joining or self.num_decode):  # waiting for KV blocks
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
                                                  self.sim.contended(self.devices),
                                                  self.size if self.tp == 1 else None, self.devices.overlapped())
            for s in joining:
                self._start_decode(s, k, s.prompt)
            for s, _ in chunks:
                if s.first_scheduled is None:
                    s.first_scheduled = env.now
            yield self.devices.run(ms + extra_ms)
            self._finish_step(k, chunks)

    def _step_budget(self) -> int:
        """serve's default: what this worker prefills in half a second by its step model;
        2,048 with TP ranks."""
        if self.tp > 1:
            return SchedulerConfig.max_num_batched_tokens
        seconds = self.step_model.step_ms([(step_budget.PROBE_TOKENS, 0)]) / 1e3
        return step_budget.from_rate(step_budget.PROBE_TOKENS / seconds)

    def _schedule(self, limits: EngineLimits) -> tuple[list[tuple[Seq, int]], list[Seq]]:
        """(prefill chunks ``(seq, tokens)``, decode-role arrivals joining this step)."""
        budget = self.budget - self.num_decode
        chunks: list[tuple[Seq, int]] = []
        for s in self.prefilling:
            if budget <= 0:
                break
            n = min(s.prompt - s.computed, budget)
            chunks.append((s, n))
            budget -= n
        joining: list[Seq] = []
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
            s.stages[f"{s.role}_queue_ms"] = (self.sim.env.now - s.enqueued) * 1e3
            if s.computed == s.prompt:
                joining.append(s)
                self._import(s)
            else:
                self.prefilling.append(s)
                chunks.append((s, n))
            running += 1
            budget -= n
        return chunks, joining

    def _import(self, s: Seq) -> None:
        """0 ms without ``kv_import_gbs``: the copy is in the step time."""
        nbytes = s.prompt * self.sim.platform.kv_bytes_per_token
        self.import_bytes += nbytes
        gbs = self.sim.platform.kv_import_gbs
        s.stages["kv_import_ms"] = nbytes / (gbs * 1e9) * 1e3 if gbs else 0.0

    def kv_blocks(self, s: Seq) -> int:
        return request_kv_blocks(s.role, s.prompt, s.req.max_tokens, self.sim.limits.block_size)

    def reserve(self, s: Seq, sign: int) -> None:
        """``sign`` 1 takes, -1 gives back (waking the loop, which may wait for them)."""
        if self.free_blocks is None:
            return
        self.free_blocks -= sign * self.kv_blocks(s)
        if sign < 0 and not self.wake.triggered:
            self.wake.succeed()

    def _prefix_hit(self, s: Seq) -> int:
        """In full blocks: the template's once cached here, through the longest start shared with a
        text prefilled here; never the last token (its logits are computed; vLLM's rule)."""
        if not self.prefix_cached:
            return 0
        hit = self.sim.cached_prefix
        text = s.req.prompt
        if text and not s.req.images:
            shared = longest_shared_start(text, self.texts.get(text[:TEXT_KEY_CHARS], []))
            if shared:
                hit = self.sim.platform.template_prefix_tokens + shared * s.req.prompt_tokens // len(text)
        size = self.sim.limits.block_size
        return min(hit // size * size, (s.prompt - 1) // size * size)

    def _max_context(self, k: int) -> int:
        while self._bases and self._gone[-self._bases[0]]:
            self._gone[-heapq.heappop(self._bases)] -= 1
        return k - self._bases[0] if self._bases else 0

    def _start_decode(self, s: Seq, k: int, context: int) -> None:
        remaining = s.req.max_tokens - len(s.tokens)
        s.first_step, s.ctx_base = k, context - k
        heapq.heappush(self._bases, -s.ctx_base)
        self.num_decode += 1
        self.decode_context += context
        self.finish_at.setdefault(k + remaining - 1, []).append(s)

    def _finish_step(self, k: int, chunks: list[tuple[Seq, int]]) -> None:
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
                bisect.insort(self.texts.setdefault(s.req.prompt[:TEXT_KEY_CHARS], []), s.req.prompt)
            s.tokens.append(now)
            s.stages["prefill_ms"] = (now - s.first_scheduled) * 1e3
            if len(s.tokens) >= s.req.max_tokens:
                self._done(s, now)
            elif s.role == "prefill":
                self.held -= 1
                self.outstanding -= s.prompt + s.req.max_tokens
                self.sim.env.process(self.sim.hand_off(s, self))
            else:
                self._start_decode(s, k + 1, s.prompt)

    def _done(self, s: Seq, now: float) -> None:
        self.held -= 1
        self.outstanding -= s.prompt + s.req.max_tokens
        self.reserve(s, -1)
        if s.role != "prefill":
            first = s.tokens[0]
            s.stages["decode_ms"] = (now - first) * 1e3
        self.sim.finish(s)


class EncodeWorker:
    """Each call encodes every share of images pending here."""

    def __init__(self, sim: Simulation, spec: WorkerSpec, devices: Devices):
        self.sim, self.role, self.devices, self.size = sim, spec.role, devices, spec.devices
        self.images: set[tuple[int, int, int]] = set()
        self.pending: list[tuple[Seq, tuple[dict, ...], float]] = []  # with arrival time
        self.outstanding = 0
        self.wake = sim.env.event()

    def submit(self, seq: Seq, images: tuple[dict, ...]) -> None:
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
