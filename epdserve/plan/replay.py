"""Steady-state replay: what a deployment sustains at a rate, measured once its queue has settled.

A trace of a few requests re-timed to a high rate is over before a queue can build up: its
requests meet their SLOs and the rate looks sustainable when it is not (measured: sent
once, 20 requests of 100-300 tokens in and 50-100 out planned colocated-2 on 2 cores at
4.68 req/s, 300 of the same shape at 2.12). So :func:`replay` sends the trace back to back at the rate under
test, until the deployment reaches a steady state or is found not to.

Copies. Copy k is the trace re-timed to the rate (:func:`epdserve.bench.workload.retime`,
as ``compare --sweep-rates`` re-times it, one seed for all copies) and shifted by k·n/rate
(n requests), so the mean rate holds across copies (a copy whose own arrivals span more
than that overlaps the next; arrivals are independent, so that is allowed). A trace with
an arrival pattern of its own brings it to every copy as it is. A trace sent all at once
has none: it gets seeded Poisson arrivals, and a copy repeats it (distinct repeats, see
below) until it holds ``MIN_POISSON_COPY`` (300) requests, so that a copy of 20 requests
holds as many short and long gaps as a copy of 300 (20 gaps repeated would leave the
goodput to the luck of one small sample: at a 90 % target, two unlucky gaps decide it).
Every copy brings the same arrivals: a deployment that keeps up settles into a regime that
repeats copy after copy, one that does not queues about the same surplus every copy.

Steady state. The replay watches the mean number of requests in flight (arrived, not
finished) that the arrivals of each copy find. It is steady at copy k ≥ 1 when that mean
moved from copy k − 1 by at most ``tolerance`` (5 %) of itself (the queue has settled) and
by at most ``tolerance`` of a copy's requests (a queue growing by a share f of the arrivals
every copy belongs to a deployment that completes only 1 − f of what arrives; the first
test alone would pass it in the end, as a constant growth is less and less of a growing
queue); changes under half a request pass both. The goodput is then measured on copies
k − 1 and k, never on copy 0 (the warm-up: it starts from an empty deployment), while the
next copies keep arriving, so the measured requests are served to the end under the same
load (not in a draining deployment). A replay not steady within ``max_copies`` copies or
``max_requests`` requests fails the rate: the deployment does not keep up with it (its
queue grows), or, close to its capacity, takes longer to settle than the bound allows.
Simulated time needs no bound of its own: it is at most the copies' arrival span plus the
service of the measured copies.

Prefix cache. The copies, and the repeats within a copy, are distinct requests, as new
users' would be: each repeat of a request keeps the start its text shares with another
request of the trace (a system prompt, a shared document, Mooncake's shared blocks: the
trace's own sharing, meant to be cached) and differs from every other repeat after it; an
image that only one request of the trace sends is a new picture in every repeat, one that
several requests send stays the same (the trace's own embedding-cache hits). Without this,
the second copy of a prompt would find the first's whole prompt in the prefix cache, which
a real user's new prompt never does. The chat template's start is cached across copies, as
in every served prompt.
"""

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

TOLERANCE = 0.05        # change of the mean in flight between two copies: of itself, of a copy's requests
MIN_CHANGE = 0.5        # requests in flight: a change below this is no change
MAX_COPIES = 40
MAX_REQUESTS = 3000     # replayed in all: the bound for a long trace
# Copy k's first character after its shared start: private-use code points that no trace
# text holds, one per copy.
MARKER_BASE = 0xF0000
# A trace sent all at once has no arrival pattern of its own: each copy draws Poisson
# arrivals for at least this many requests (the trace repeated; plan's default trace size),
# so that a short trace's copy holds as many gaps, short and long, as a long trace's.
MIN_POISSON_COPY = 300


@dataclass
class Replay:
    """The outcome of :func:`replay`.

    ``records``: the client records of the measured copies (empty when not steady);
    ``copies``: copies whose arrivals the steady-state test saw (warm-up included), of
    ``copy_size`` requests each; ``steady``: a steady state was reached; ``in_flight``: the
    mean number of requests in flight the arrivals of each of those copies found;
    ``measured``: the copies measured; ``sim``: the simulation (an elastic deployment's
    controller holds its decisions)."""

    records: list[RequestRecord]
    copies: int
    copy_size: int
    steady: bool
    in_flight: list[float]
    measured: tuple[int, ...] = ()
    sim: Simulation | None = None


class Copier:
    """Distinct copies of a trace (see the module doc, *Prefix cache*), of ``tiles`` distinct
    repeats of it each (see *Copies*)."""

    def __init__(self, requests: list[workload.Request], tiles: int = 1):
        self.requests, self.tiles = requests, tiles
        self.shared_chars = shared_starts([r.prompt for r in requests])
        senders = Counter(seed for r in requests for seed in {im["seed"] for im in r.images})
        self.shared_seeds = {seed for seed, n in senders.items() if n > 1}
        self.seed_stride = max(senders, default=-1) + 1  # repeat m's own images: seed + m × this

    def distinct(self, m: int) -> list[workload.Request]:
        """Repeat ``m`` of the trace, distinct from every other repeat (0: the trace itself),
        at the trace's offsets."""
        if m == 0:
            return list(self.requests)
        marker = chr(MARKER_BASE + m)
        return [replace(r, prompt=r.prompt and r.prompt[:cut] + marker + r.prompt[cut:],
                        images=tuple(im if im["seed"] in self.shared_seeds else
                                     dict(im, seed=im["seed"] + m * self.seed_stride) for im in r.images))
                for r, cut in zip(self.requests, self.shared_chars)]

    def unit(self, rate: float, seed: int) -> list[workload.Request]:
        """One copy, re-timed to ``rate`` req/s (:func:`~epdserve.bench.workload.retime`):
        repeats 0 to ``tiles`` − 1 of the trace, one after the other."""
        return retime([r for j in range(self.tiles) for r in self.distinct(j)], rate, seed)

    def copy(self, unit: list[workload.Request], k: int, start_s: float) -> list[workload.Request]:
        """Copy ``k`` of ``unit`` (:meth:`unit`; copy 0 is ``unit``), its arrivals from
        ``start_s`` on (seconds): repeats ``k·tiles`` to ``(k + 1)·tiles − 1``."""
        n = len(self.requests)
        return [replace(fresh, offset_s=start_s + timed.offset_s)
                for j in range(self.tiles)
                for fresh, timed in zip(self.distinct(k * self.tiles + j), unit[j * n:(j + 1) * n])]


def shared_starts(texts: list[str]) -> list[int]:
    """For each text, the characters its start shares with another text of ``texts`` (its
    whole length for a text that another equals or starts with): its neighbours in sorted
    order share the most."""
    order = sorted(range(len(texts)), key=texts.__getitem__)
    out = [0] * len(texts)
    for pos, i in enumerate(order):
        near = [order[p] for p in (pos - 1, pos + 1) if 0 <= p < len(order)]
        out[i] = max((common_start(texts[i], texts[j]) for j in near), default=0)
    return out


def replay(deployment: Deployment, platform: Platform, requests: list[workload.Request], rate: float,
           limits: EngineLimits = EngineLimits(), seed: int = 0, tolerance: float = TOLERANCE,
           max_copies: int = MAX_COPIES, max_requests: int = MAX_REQUESTS) -> Replay:
    """Replay ``requests`` back to back at ``rate`` req/s with ``deployment`` until the
    deployment is steady (see the module doc); ``seed``: the arrivals of a trace sent all
    at once (:func:`~epdserve.bench.workload.retime`). At least 2 copies are replayed,
    whatever the bounds.

    Raises:
        KVCapacityError, ValueError: as :func:`~epdserve.plan.simulate.simulate`.
        TraceError: ``rate`` is not a finite number > 0.
    """
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
    """Whether the trace is sent all at once (every offset the same): it has no arrival
    pattern of its own, and a re-timed copy gets seeded Poisson arrivals
    (:func:`~epdserve.bench.workload.retime`), a sequence per seed. A trace whose offsets
    differ keeps its own arrivals, scaled to the rate, whatever the seed."""
    return len({r.offset_s for r in requests}) == 1


def settled(before: float, now: float, copy_size: int, tolerance: float = TOLERANCE) -> bool:
    """Whether the mean in flight of two consecutive copies (``before``, ``now``: requests)
    is steady: changed by at most ``tolerance`` of itself and of ``copy_size``, or by less
    than :data:`MIN_CHANGE` (see the module doc)."""
    change = abs(now - before)
    return change <= max(tolerance * min(before, copy_size), MIN_CHANGE)


def _feed(sim: Simulation, copier: Copier, base: list[workload.Request], period: float, copies: int):
    """Add copy k to ``sim`` at (k − 1)·``period``, before any of its arrivals, for k below
    ``copies``: those the test looks at and one more arriving behind them."""
    for k in range(copies):
        sim.add(copier.copy(base, k, k * period), k * len(base))
        if k:
            yield sim.env.timeout(period)
