"""Discrete-event simulation of a deployment serving a trace (SimPy).

The simulated engine follows epdserve's scheduler (engine/scheduler.py, vLLM v1 policy):
each step gives every running sequence its next tokens (decodes one, a chunked prefill its
next chunk), then admits waiting sequences while ``max_num_seqs`` and
``max_num_batched_tokens`` allow; without chunked prefill a prompt is prefilled whole.
A step lasts what the platform's step model says. The router sends a request to the
worker of the role with the least outstanding tokens (prompt + max_tokens), as
serving/router.py does. In PD the first token is streamed when the prefill worker samples
it; the KV then crosses ``kv_link`` and the decode worker copies it in during its next
step (``kv_import_gbs``). KV memory is assumed sufficient (no preemption).

Requests are :class:`~epdserve.bench.workload.Request` (a bench trace); the simulator
reads their offsets, token counts and images, not the text. Each request yields the
client's view as a :class:`~epdserve.bench.client.RequestRecord`
(so :func:`epdserve.bench.metrics.compute` gives TTFT/ITL/TPOT/E2EL and goodput exactly as
for a measured run) and a server-side stage record with the keys the router's trace uses
(``prefill_queue_ms``, ``prefill_ms``, ``kv_transfer_ms``, ``decode_queue_ms``, ...).
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass

import simpy

from epdserve.bench.client import RequestRecord
from epdserve.bench.workload import Request
from epdserve.plan.costmodel import Platform, StepModel

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker: its role and how many devices (cores or GPUs, tensor parallel) it has."""

    role: str
    devices: int = 1


@dataclass(frozen=True)
class Deployment:
    """A named set of workers, e.g. ``2p1d`` = two prefill and one decode worker."""

    name: str
    workers: tuple[WorkerSpec, ...]

    @property
    def devices(self) -> int:
        return sum(w.devices for w in self.workers)

    @property
    def mode(self) -> str:
        return "pd" if any(w.role == "prefill" for w in self.workers) else "colocated"


@dataclass(frozen=True)
class EngineLimits:
    """Scheduler settings of every simulated worker (as ``epdserve serve`` takes them)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = False


class _Seq:
    """A request inside the simulation; times are simulated seconds."""

    __slots__ = ("index", "req", "prompt", "computed", "tokens", "arrival", "enqueued",
                 "stages", "first_step", "ctx_base")

    def __init__(self, index: int, req: Request, prompt: int, arrival: float):
        self.index, self.req, self.prompt = index, req, prompt
        self.computed = 0
        self.tokens: list[float] = []  # server time of each generated token
        self.arrival = arrival
        self.enqueued = arrival
        self.stages: dict[str, float] = {}
        self.first_step = 0
        self.ctx_base = 0


class _Worker:
    def __init__(self, sim: "_Simulation", spec: WorkerSpec, step: StepModel):
        self.sim, self.role, self.step_model = sim, spec.role, step
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.num_decode = 0
        self.decode_context = 0          # Σ cached tokens of the decoding sequences
        self._bases: list[int] = []      # max-heap (negated) of their ctx_base ...
        self._gone: Counter = Counter()  # ... with lazy deletion of finished ones
        self.finish_at: dict[int, list[_Seq]] = {}
        self.step_times: list[float] = []
        self.outstanding = 0
        self.import_bytes = 0.0          # KV to copy in during the next step
        self.wake = sim.env.event()

    def submit(self, seq: _Seq) -> None:
        seq.enqueued = self.sim.env.now
        self.waiting.append(seq)
        self.outstanding += seq.prompt + seq.req.max_tokens
        if not self.wake.triggered:
            self.wake.succeed()

    def run(self):
        env, limits = self.sim.env, self.sim.limits
        while True:
            if not (self.waiting or self.prefilling or self.num_decode):
                self.wake = env.event()
                yield self.wake
                continue
            k = len(self.step_times)
            chunks, joining = self._schedule(limits)
            extra_ms = sum(self.sim.platform.encode_ms_per_image * len(s.req.images)
                           for s, _ in chunks if s.computed == 0)
            if self.import_bytes and self.sim.platform.kv_import_gbs:
                extra_ms += self.import_bytes / (self.sim.platform.kv_import_gbs * 1e9) * 1e3
            self.import_bytes = 0.0
            ms = self.step_model.step_ms([(n, s.computed) for s, n in chunks],
                                         self.num_decode + len(joining),
                                         self.decode_context + sum(s.prompt for s in joining),
                                         max([self._max_context(k)] + [s.prompt for s in joining]))
            for s in joining:
                self._start_decode(s, k, s.prompt)
            for s, _ in chunks:
                s.stages.setdefault("first_scheduled", env.now)
            yield env.timeout((ms + extra_ms) / 1e3)
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
            n = 1 if s.computed == s.prompt else s.prompt - s.computed  # KV arrived: one token
            if n > budget and not limits.enable_chunked_prefill:
                break
            n = min(n, budget)
            self.waiting.popleft()
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
            if s.computed < s.prompt:
                continue
            self.prefilling.remove(s)
            s.tokens.append(now)
            s.stages["prefill_ms"] = (now - s.stages.pop("first_scheduled")) * 1e3
            if len(s.tokens) >= s.req.max_tokens:
                self._done(s, now)
            elif self.role == "prefill":
                self.outstanding -= s.prompt + s.req.max_tokens
                self.sim.env.process(self.sim.hand_off(s))
            else:
                self._start_decode(s, k + 1, s.prompt)

    def _done(self, s: _Seq, now: float) -> None:
        self.outstanding -= s.prompt + s.req.max_tokens
        if self.role != "prefill":
            first = s.tokens[0]
            s.stages["decode_ms"] = (now - first) * 1e3
        self.sim.finish(s)


class _Simulation:
    def __init__(self, deployment: Deployment, platform: Platform, limits: EngineLimits):
        self.env = simpy.Environment()
        self.platform, self.limits, self.deployment = platform, limits, deployment
        self.workers = [_Worker(self, w, platform.step(w.devices)) for w in deployment.workers]
        self.finished: list[_Seq] = []
        for w in self.workers:
            self.env.process(w.run())

    def pick(self, role: str) -> _Worker:
        return min((w for w in self.workers if w.role == role), key=lambda w: w.outstanding)

    def arrive(self, index: int, req: Request):
        yield self.env.timeout(req.offset_s)
        seq = _Seq(index, req, req.prompt_tokens + self.platform.template_tokens, self.env.now)
        yield self.env.timeout(self.platform.router_ms / 1e3)
        self.pick("prefill" if self.deployment.mode == "pd" else "colocated").submit(seq)

    def hand_off(self, s: _Seq):
        ms = self.platform.kv_link.transfer_ms(s.prompt * self.platform.kv_bytes_per_token)
        s.stages["kv_bytes"] = float(s.prompt * self.platform.kv_bytes_per_token)
        s.stages["kv_transfer_ms"] = ms
        yield self.env.timeout(ms / 1e3)
        s.computed = s.prompt
        self.pick("decode").submit(s)

    def finish(self, s: _Seq) -> None:
        self.finished.append(s)


def _check(deployment: Deployment, requests: list[Request], limits: EngineLimits,
           template_tokens: int) -> None:
    roles = {w.role for w in deployment.workers}
    if not deployment.workers or roles - set(ROLES) or ("prefill" in roles) != ("decode" in roles) \
            or ("colocated" in roles and "prefill" in roles):
        raise ValueError(f"deployment {deployment.name}: needs colocated workers, or prefill "
                         f"and decode workers (got {sorted(roles)})")
    for i, r in enumerate(requests):
        if r.prompt_tokens < 1 or r.max_tokens < 1:
            raise ValueError(f"request {i}: prompt_tokens and max_tokens must be >= 1")
        if r.prompt_tokens + template_tokens > limits.max_num_batched_tokens \
                and not limits.enable_chunked_prefill:
            raise ValueError(f"request {i}: a {r.prompt_tokens}-token prompt exceeds "
                             f"max_num_batched_tokens={limits.max_num_batched_tokens} "
                             f"without chunked prefill")


def simulate(deployment: Deployment, platform: Platform, requests: list[Request],
             limits: EngineLimits = EngineLimits()) -> tuple[list[RequestRecord], list[dict]]:
    """Serve ``requests`` with ``deployment`` on ``platform``; return the client records
    (trace order; times in seconds as the bench client measures them, ``router_ms`` added
    on the way in) and the server stage records (ms; ``kv_bytes`` in bytes).

    Raises:
        ValueError: a deployment without a complete set of roles, an empty request, or a
            prompt that can never be scheduled with these limits.
    """
    _check(deployment, requests, limits, platform.template_tokens)
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
