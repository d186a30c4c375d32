"""Steady-state replay: the trace sent back to back at the rate under test until the deployment's
queue settles (or is found to grow), so a short trace cannot make a rate look sustainable;
copies are distinct requests, as new users' would be (docs/planner.md, "Steady-state replay")."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from epdserve.bench import workload
from epdserve.bench.client import RequestRecord
from epdserve.plan.costmodel import Platform
from epdserve.plan.sim_worker import common_start
from epdserve.plan.simulate import Deployment, EngineLimits, Simulation, check
from epdserve.bench.arrivals import retime

TOLERANCE = 0.05  # of the mean in flight itself, and of a copy's requests
MIN_CHANGE = 0.5  # requests in flight
MAX_COPIES = 40
MAX_REQUESTS = 3000
# Private-use code points no trace text holds: copy k's marker after its shared start.
MARKER_BASE = 0xF0000
# Requests per copy of a trace sent all at once, so a short trace is not judged on a few gaps.
MIN_POISSON_COPY = 300


@dataclass
class Replay:
    """``records``: the measured copies' (empty when not steady); ``copies`` of ``copy_size``,
    warm-up included; ``in_flight``: mean in flight that each copy's arrivals found."""

    records: list[RequestRecord]
    copies: int
    copy_size: int
    steady: bool
    in_flight: list[float]
    measured: tuple[int, ...] = ()
    sim: Simulation | None = None


class Copier:
    """Distinct copies of a trace, each of ``tiles`` distinct repeats of it."""

    def __init__(self, requests: list[workload.Request], tiles: int = 1):
        self.requests, self.tiles = requests, tiles
        self.shared_chars = shared_starts([r.prompt for r in requests])
        senders = Counter(seed for r in requests for seed in {im["seed"] for im in r.images})
        self.shared_seeds = {seed for seed, n in senders.items() if n > 1}
        self.seed_stride = max(senders, default=-1) + 1  # repeat m's own images: seed + m × this

    def distinct(self, m: int) -> list[workload.Request]:
        """Repeat ``m`` (0: the trace), distinct after each prompt's shared start and in
        images only one request sends."""
        if m == 0:
            return list(self.requests)
        marker = chr(MARKER_BASE + m)
        return [replace(r, prompt=r.prompt and r.prompt[:cut] + marker + r.prompt[cut:],
                        images=tuple(im if im["seed"] in self.shared_seeds else
                                     dict(im, seed=im["seed"] + m * self.seed_stride) for im in r.images))
                for r, cut in zip(self.requests, self.shared_chars)]

    def unit(self, rate: float, seed: int) -> list[workload.Request]:
        return retime([r for j in range(self.tiles) for r in self.distinct(j)], rate, seed)

    def copy(self, unit: list[workload.Request], k: int, start_s: float) -> list[workload.Request]:
        """Copy ``k`` (repeats k·tiles to (k+1)·tiles − 1), arrivals from ``start_s``."""
        n = len(self.requests)
        return [replace(fresh, offset_s=start_s + timed.offset_s)
                for j in range(self.tiles)
                for fresh, timed in zip(self.distinct(k * self.tiles + j), unit[j * n:(j + 1) * n])]


def shared_starts(texts: list[str]) -> list[int]:
    """Characters each text's start shares with another text (all of it if another equals
    or starts with it); sorted neighbours share the most."""
    order = sorted(range(len(texts)), key=texts.__getitem__)
    out = [0] * len(texts)
    for pos, i in enumerate(order):
        near = [order[p] for p in (pos - 1, pos + 1) if 0 <= p < len(order)]
        out[i] = max((common_start(texts[i], texts[j]) for j in near), default=0)
    return out


def replay(deployment: Deployment, platform: Platform, requests: list[workload.Request], rate: float,
           limits: EngineLimits = EngineLimits(), seed: int = 0, tolerance: float = TOLERANCE,
           max_copies: int = MAX_COPIES, max_requests: int = MAX_REQUESTS) -> Replay:
    """At least 2 copies whatever the bounds; ``seed``: the arrivals of a trace sent all at once.

    Raises KVCapacityError, ValueError as simulate; TraceError for a rate not finite and > 0."""
    check(deployment, platform, requests, limits)
    copier = Copier(requests, -(-MIN_POISSON_COPY // len(requests)) if sent_at_once(requests) else 1)
    base = copier.unit(rate, seed)
    n, period = len(base), len(base) / rate
    last_s = max(r.offset_s for r in base)
    limit = max(2, min(max_copies, max_requests // n))
    sim = Simulation(deployment, platform, limits)
    sim.env.process(_feed(sim, copier, base, period, limit + 1))
    in_flight: list[float] = []
    for k in range(limit):
        # Just past copy k's last arrival: SimPy stops before the events of the instant it is given.
        sim.env.run(until=k * period + last_s + 1e-6)
        in_flight.append(float(np.mean([sim.in_flight_seen[i] for i in range(k * n, (k + 1) * n)])))
        if k and settled(in_flight[k - 1], in_flight[k], n, tolerance):
            measured = tuple(range(max(1, k - 1), k + 1))
            indices = range(measured[0] * n, (measured[-1] + 1) * n)
            sim.env.run(until=sim.until_finished(indices))
            return Replay(sim.results(indices)[0], k + 1, n, True, in_flight, measured, sim)
    return Replay([], limit, n, False, in_flight, sim=sim)


def sent_at_once(requests: list[workload.Request]) -> bool:
    """Every offset equal: no arrival pattern of its own, so copies get seeded Poisson arrivals."""
    return len({r.offset_s for r in requests}) == 1


def settled(before: float, now: float, copy_size: int, tolerance: float = TOLERANCE) -> bool:
    """Changed by at most ``tolerance`` of itself and of ``copy_size`` (a steadily growing queue
    fails the latter), or by under :data:`MIN_CHANGE`."""
    change = abs(now - before)
    return change <= max(tolerance * min(before, copy_size), MIN_CHANGE)


def _feed(sim: Simulation, copier: Copier, base: list[workload.Request], period: float, copies: int):
    """Copy k at (k − 1)·``period``: the ones tested and one more arriving behind them."""
    for k in range(copies):
        sim.add(copier.copy(base, k, k * period), k * len(base))
        if k:
            yield sim.env.timeout(period)
