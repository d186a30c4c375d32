"""When requests are sent: arrival times of generated traces and re-timing of a trace.

Arrivals (:func:`arrival_offsets`, vLLM ``bench serve`` semantics): gamma-distributed
gaps with mean 1/rate and shape ``burstiness`` (1 = Poisson), optionally with the rate
rising linearly from request to request (vLLM's linear ramp-up); rate ``inf`` sends
everything at t = 0. A cap on requests in flight is the client's (``--max-concurrency``).
:func:`retime` re-spaces a trace for another rate (the goodput sweep).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from epdserve.bench.traces import Request, TraceError


def arrival_offsets(num: int, rate: float, rng: np.random.Generator, burstiness: float = 1.0,
                    ramp: tuple[float, float] | None = None) -> list[float]:
    """Send times (s) of ``num`` requests: the first at 0, then gaps drawn from a gamma
    distribution with shape ``burstiness`` and scale 1/(rate·burstiness), so mean 1/rate
    and coefficient of variation 1/sqrt(burstiness) — vLLM ``bench serve``'s definition:
    burstiness 1 is a Poisson process (exponential gaps), < 1 burstier, > 1 steadier.

    ``ramp=(A, B)`` (req/s) replaces ``rate``: the gap before request i is drawn at rate
    A + (B − A)·i/(num − 1), rising linearly over the run (vLLM's linear ramp-up).
    ``rate`` = inf (and no ramp): all at 0.

    Raises:
        TraceError: rate or a ramp end <= 0, or burstiness <= 0.
    """
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
        # Gamma(1, s) is Exponential(s); drawing it as such keeps seeded Poisson traces
        # identical to the ones made before gamma arrivals existed.
        gaps = rng.exponential(1.0 / rates[1:])
    else:
        gaps = rng.gamma(burstiness, 1.0 / (rates[1:] * burstiness))
    return [0.0] + [float(x) for x in np.cumsum(gaps)]


def retime(requests: list[Request], rate: float, seed: int = 0) -> list[Request]:
    """The same requests re-spaced to a mean arrival rate of ``rate`` req/s: offsets scaled
    by (current mean rate)/``rate``, keeping the pattern (bursts, long-prompt positions).
    A trace sent all at t = 0 has no pattern to keep; it gets Poisson offsets (seeded).

    Raises:
        TraceError: ``rate`` is not a finite number > 0.
    """
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
    """``rate`` (req/s) if > 0 (inf allowed), else TraceError."""
    if not (rate > 0):  # also rejects NaN
        raise TraceError(f"request rate {rate}: must be > 0 (inf = all at once)")
    return rate
