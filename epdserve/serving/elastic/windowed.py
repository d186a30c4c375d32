"""The numbers the elastic policies decide on: a :class:`Window` of the settled samples."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from epdserve.serving.elastic.samples import Sample


@dataclass(frozen=True)
class Window:
    """The numbers of the settled samples: times in ms (p90s nearest rank, 0 without values), the
    arrivals' mean prompt and ``max_tokens``, per-worker counts as means over the samples, and
    prompt tokens/s arriving (demand) and one worker prefills (speed; 0: not measured).
    Definitions: docs/elastic.md, "The signals"."""
    span_s: float
    arrivals: int
    prompt_avg: float
    answer_avg: float
    ttft_p90: float
    queue_p90: float
    itl_p90: float
    itl_max: float
    n_ttft: int
    n_itl: int
    decode_batch: float
    kv_p90: float
    waiting_prefill: float
    waiting_decode: float
    inflight: float
    demand_tok_s: float = 0.0
    prefill_tok_s: float = 0.0

    def prefill_load(self) -> float | None:
        """Prefill demand in busy workers; None when the speed was not measured."""
        return self.demand_tok_s / self.prefill_tok_s if self.prefill_tok_s > 0 else None

    @property
    def ratio(self) -> float:
        return self.prompt_avg / max(self.answer_avg, 1.0)

    def as_signals(self) -> dict[str, float]:
        return {"span_s": self.span_s, "arrivals": self.arrivals,
                "prompt_avg_tok": self.prompt_avg, "answer_avg_tok": self.answer_avg,
                "prompt_answer_ratio": self.ratio, "ttft_p90_ms": self.ttft_p90,
                "prefill_queue_p90_ms": self.queue_p90, "itl_p90_ms": self.itl_p90,
                "itl_max_ms": self.itl_max,
                "ttfts": self.n_ttft, "itl_gaps": self.n_itl, "decode_batch": self.decode_batch,
                "kv_usage_p90": self.kv_p90, "waiting_prefill": self.waiting_prefill,
                "waiting_decode": self.waiting_decode, "inflight_per_worker": self.inflight,
                "prefill_demand_tok_s": self.demand_tok_s, "prefill_speed_tok_s": self.prefill_tok_s}


def _quantile(values: list[float], q: float) -> float:
    """Nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


MIN_SPEED_TOKENS = 64  # shorter prefills are mostly fixed costs: no measure of the speed


def measure(samples: Sequence[Sample], q: float) -> Window:
    """``samples``: oldest first, at least one; ``q``: the quantile of the per-event values."""
    arrivals = [a for s in samples for a in s.arrivals]
    decoders = [[w for w in s.workers if w.role != "prefill"] for s in samples]
    span_s = samples[-1].t - samples[0].t
    # TTFT less queue is the prefill; the fastest is the speed (chunked prefills share steps)
    speeds = [n / (t - q) * 1e3 for s in samples
              for t, q, n in zip(s.ttfts_ms, s.prefill_queue_ms, s.prefill_tokens)
              if n >= MIN_SPEED_TOKENS and t > q]
    return Window(
        span_s=span_s,
        arrivals=len(arrivals),
        prompt_avg=_mean([p for p, _ in arrivals]), answer_avg=_mean([m for _, m in arrivals]),
        ttft_p90=_quantile([x for s in samples for x in s.ttfts_ms], q),
        queue_p90=_quantile([x for s in samples for x in s.prefill_queue_ms], q),
        itl_p90=_quantile([x for s in samples for x in s.itls_ms], q),
        itl_max=max((x for s in samples for x in s.itls_ms), default=0.0),
        n_ttft=sum(len(s.ttfts_ms) for s in samples),
        n_itl=sum(len(s.itls_ms) for s in samples),
        decode_batch=_mean([_mean([w.num_running for w in d]) for d in decoders if d]),
        kv_p90=_quantile([max(w.kv_usage for w in d) for d in decoders if d], q),
        waiting_prefill=_mean([sum(w.num_waiting for w in s.workers if w.role == "prefill")
                               for s in samples]),
        waiting_decode=_mean([sum(w.num_waiting for w in d) for d in decoders]),
        inflight=_mean([_mean([w.outstanding for w in s.workers])
                        for s in samples if s.workers]),
        demand_tok_s=sum(p for p, _ in arrivals) / span_s if span_s > 0 else 0.0,
        prefill_tok_s=max(speeds, default=0.0))


def settled(samples: Sequence[Sample], since: float) -> list[Sample]:
    """The trailing samples after ``since`` with the last sample's workers, roles and switching."""
    if not samples:
        return []
    now = _roles(samples[-1])
    kept = len(samples)
    while kept > 0 and samples[kept - 1].t > since and _roles(samples[kept - 1]) == now:
        kept -= 1
    return list(samples[kept:])


def _roles(sample: Sample) -> frozenset:
    return frozenset((w.worker_id, w.role, w.switching) for w in sample.workers)
