"""The elastic scaling policy: add an engine worker, retire one, or hold, within ``[min_workers,
max_workers]`` (``serve --elastic --max-workers``); a pure function of the samples, as the role
policy. Conditions and bands: docs/elastic.md, "Adding and removing workers"."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from epdserve.serving.deployment import ELASTIC_MIN_DWELL_S, ELASTIC_WINDOW_S, natural_order
from epdserve.serving.elastic.samples import Sample
from epdserve.serving.elastic.windowed import measure, settled


@dataclass(frozen=True)
class ScalingConfig:
    """Bounds (workers), SLOs (ms) and thresholds. Raises ValueError naming the field: ``min_workers``
    < 1, ``max_workers`` < ``min_workers``, a non-positive SLO, window or threshold, or ``idle_enter``
    not below ``waiting_enter`` (the band between scale in and out)."""
    min_workers: int
    max_workers: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    window_s: float = ELASTIC_WINDOW_S
    evidence_s: float = 18.0    # settled samples must span this long: the window less one interval
    min_dwell_s: float = ELASTIC_MIN_DWELL_S   # since the last change of roles or count
    quantile: float = 0.9
    ttft_enter: float = 1.0     # x the SLO (as itl_enter)
    itl_enter: float = 1.2
    waiting_enter: float = 1.0  # requests waiting on a worker: saturated; so is big_batch running (decode)
    big_batch: float = 4.0
    idle_enter: float = 0.25    # in flight per worker, in every sample

    def __post_init__(self):
        if self.min_workers < 1 or self.max_workers < self.min_workers:
            raise ValueError(f"ScalingConfig: need 1 <= min_workers ({self.min_workers}) <= "
                             f"max_workers ({self.max_workers})")
        for name in ("slo_ttft_ms", "slo_tpot_ms", "window_s", "evidence_s", "ttft_enter", "itl_enter",
                     "waiting_enter", "big_batch", "idle_enter"):
            if not getattr(self, name) > 0 or math.isinf(getattr(self, name)):
                raise ValueError(f"ScalingConfig {name}: expected a finite number > 0, got {getattr(self, name)!r}")
        if not self.idle_enter < self.waiting_enter:
            raise ValueError(f"ScalingConfig idle_enter {self.idle_enter!r} must be < waiting_enter "
                             f"{self.waiting_enter!r} (a hysteresis band)")


@dataclass(frozen=True)
class ScalingState:
    """``last_change_t``: the last change of the worker count (s, the samples' clock)."""
    last_change_t: float = -math.inf


@dataclass(frozen=True)
class ScaleDecision:
    """At ``t`` (s): ``action`` ``hold``, ``scale-out`` (add a ``role`` worker) or ``scale-in`` (retire
    ``worker_id``)."""
    t: float
    action: str
    reason: str
    role: str | None = None
    worker_id: str | None = None
    signals: dict[str, float] = field(default_factory=dict)


def _saturated(samples: Sequence[Sample], c: ScalingConfig) -> tuple[str | None, str]:
    win = measure(samples, c.quantile)

    def every(role_of, busy) -> bool:
        groups = [[w for w in s.workers if role_of(w.role)] for s in samples]
        return all(g and all(busy(w) for w in g) for g in groups)

    split = any(w.role == "prefill" for w in samples[-1].workers)
    prefillers = (lambda r: r == "prefill") if split else (lambda r: r == "colocated")
    if win.ttft_p90 > c.ttft_enter * c.slo_ttft_ms and every(prefillers, lambda w: w.num_waiting >= c.waiting_enter):
        return "prefill", (f"TTFT p90 {win.ttft_p90:.0f} ms > {c.ttft_enter:g} x TTFT SLO {c.slo_ttft_ms:g} ms "
                           f"with >= {c.waiting_enter:g} waiting on every prefill-capable worker for {win.span_s:.0f} s")
    if win.itl_p90 > c.itl_enter * c.slo_tpot_ms and every(
            lambda r: r != "prefill", lambda w: w.num_running >= c.big_batch or w.num_waiting >= c.waiting_enter):
        return "decode", (f"ITL p90 {win.itl_p90:.0f} ms > {c.itl_enter:g} x TPOT SLO {c.slo_tpot_ms:g} ms with "
                          f">= {c.big_batch:g} running or a request waiting on every decode-capable worker "
                          f"for {win.span_s:.0f} s")
    return None, ""


def _retiree(now: Sample) -> str | None:
    """The highest id whose role keeps another live worker."""
    count: dict[str, int] = {}
    for w in now.workers:
        count[w.role] = count.get(w.role, 0) + 1
    for w in sorted(now.workers, key=lambda w: natural_order(w.worker_id), reverse=True):
        if count[w.role] > 1:
            return w.worker_id
    return None


def _guard(samples: Sequence[Sample], state: ScalingState, c: ScalingConfig, changing: int,
           role_change_t: float) -> str | None:
    now = samples[-1]
    switching = [w.worker_id for w in now.workers if w.switching]
    if switching or changing:
        return f"{', '.join(switching) or changing} still switching, starting or retiring"
    last = max(state.last_change_t, role_change_t)
    if now.t - last < c.min_dwell_s:
        return f"{now.t - last:.1f} s since the last change < min dwell {c.min_dwell_s:g} s"
    return None


def decide_scale(samples: Sequence[Sample], state: ScalingState, config: ScalingConfig, *,
                 changing: int = 0, role_change_t: float = -math.inf) -> tuple[ScaleDecision, ScalingState]:
    """``samples``: the window, oldest first, of the live workers that take work (not the retiring);
    ``changing``: workers starting or retiring; ``role_change_t``: the role policy's ``last_switch_t``.
    Raises ValueError for no samples."""
    if not samples:
        raise ValueError("decide_scale: no samples in the window (the last one is now)")
    now = samples[-1]
    live = len(now.workers)
    held = _guard(samples, state, config, changing, role_change_t)
    if held:
        return ScaleDecision(now.t, "hold", held), state
    recent = settled(samples, max(state.last_change_t, role_change_t))
    if not recent or recent[-1].t - recent[0].t < config.evidence_s:
        span = recent[-1].t - recent[0].t if recent else 0.0
        return ScaleDecision(now.t, "hold", f"too little evidence: {span:.0f} s of settled samples "
                             f"< {config.evidence_s:g} s"), state
    win = measure(recent, config.quantile)
    signals = {**win.as_signals(), "live_workers": live, "min_workers": config.min_workers,
               "max_workers": config.max_workers}
    side, why = _saturated(recent, config)
    if side is not None and live < config.max_workers:
        layout = {w.role for w in now.workers}
        role = side if side in layout else "colocated"
        return (ScaleDecision(now.t, "scale-out", f"{why}: saturated, {live} < max {config.max_workers} workers "
                              f"-> add a {role} worker", role=role, signals=signals), ScalingState(now.t))
    busiest = max((sum(w.outstanding for w in s.workers) / max(len(s.workers), 1) for s in recent), default=0.0)
    target = _retiree(now)
    if busiest < config.idle_enter and live > config.min_workers and target is not None:
        return (ScaleDecision(now.t, "scale-in", f"at most {busiest:.2f} requests in flight per worker < "
                              f"{config.idle_enter:g} for {win.span_s:.0f} s, {live} > min {config.min_workers} "
                              f"workers -> retire {target}", worker_id=target, signals=signals), ScalingState(now.t))
    bound = (f"; saturated but at max {config.max_workers}" if side else
             f"; idle but at min {config.min_workers}" if busiest < config.idle_enter else "")
    return ScaleDecision(now.t, "hold", f"{busiest:.2f} in flight per worker at most, no saturation{bound}",
                         signals=signals), state
