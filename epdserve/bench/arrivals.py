"""Send times of generated traces (vLLM ``bench serve`` semantics), and re-timing a trace for
another rate (the goodput sweep)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from epdserve.bench.traces import Request, TraceError


def arrival_offsets(num: int, rate: float, rng: np.random.Generator, burstiness: float = 1.0,
                    ramp: tuple[float, float] | None = None) -> list[float]:
    """Send times (s): the first at 0, then gamma gaps of shape ``burstiness`` and mean 1/rate
    (CV 1/sqrt(burstiness): 1 is Poisson, < 1 burstier); ``ramp=(A, B)`` req/s rises linearly
    over the requests instead (vLLM's ramp-up); rate inf: all at 0.

    Raises TraceError: a rate or ramp end <= 0, or burstiness <= 0."""
    if not (burstiness > 0) or math.isinf(burstiness):
        raise TraceError(f"burstiness {burstiness}: must be a finite number > 0")
    if ramp is not None:
        if not (0 < ramp[0] < math.inf and 0 < ramp[1] < math.inf):
            raise TraceError(f"ramp-up {ramp[0]}->{ramp[1]} req/s: both must be finite and > 0")
        rates = np.linspace(ramp[0], ramp[1], num) if num > 1 else np.array([ramp[0]])
    else:
        check_rate(rate)
        if math.isinf(rate):
            return [0.0] * num
        rates = np.full(num, rate)
    if num <= 0:
        return []
    if burstiness == 1.0:
        # Exponential, as Gamma(1, s) is: keeps seeded Poisson traces as they were before gammas.
        gaps = rng.exponential(1.0 / rates[1:])
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rates[1:] * burstiness))
    return [0.0] + [float(x) for x in np.cumsum(gaps)]


def retime(requests: list[Request], rate: float, seed: int = 0) -> list[Request]:
    """Offsets scaled to a mean rate of ``rate`` req/s, keeping the pattern; a trace sent all
    at 0 gets seeded Poisson offsets. Raises TraceError for a rate not finite and > 0."""
    if not (0 < rate < math.inf):
        raise TraceError(f"rate {rate}: must be a finite number > 0 req/s")
    if len(requests) < 2:
        return list(requests)
    span = max(r.offset_s for r in requests) - min(r.offset_s for r in requests)
    if span == 0:
        order = sorted(range(len(requests)), key=lambda i: requests[i].offset_s)
        offsets = arrival_offsets(len(requests), rate, np.random.default_rng(seed))
        new = list(requests)
        for i, off in zip(order, offsets):
            new[i] = replace(requests[i], offset_s=round(off, 6))
        return new
    scale = span / (len(requests) - 1) * rate  # = (current rate) / rate
    start = min(r.offset_s for r in requests)
    return [replace(r, offset_s=round((r.offset_s - start) / scale, 6)) for r in requests]


def check_rate(rate: float) -> float:
    """``rate`` (req/s) if > 0, inf allowed; else TraceError."""
    if not (rate > 0):  # also rejects NaN
        raise TraceError(f"request rate {rate}: must be > 0 (inf = all at once)")
    return rate
