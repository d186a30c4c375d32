"""Which deployment serves a workload within its SLOs at the lowest cost: each candidate's
simulated goodput as DistServe defines it (Zhong et al., OSDI 2024), by doubling then bisecting
the rate, each rate replayed to a steady queue, over several arrival seeds (docs/planner.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epdserve.bench import metrics, workload
from epdserve.bench.sweep import find_max_goodput_rate
from epdserve.plan import replay
from epdserve.plan.costmodel import Platform
from epdserve.plan.simulate import Deployment, EngineLimits, WorkerSpec, serve
from epdserve.bench.arrivals import retime
from epdserve.serving.deployment import tp_suffix

MAX_DOUBLINGS = 16


def candidates(platform: Platform, budget: int, images: bool = False) -> list[Deployment]:
    """Deployments of exactly ``budget`` devices: ``colocated`` (one process), ``colocated-N``,
    ``XpYd[-tpS|-tpP/D]`` (TP workers, one rank a device), and with ``images`` ``XeYpZd`` (1-device
    encode workers) and ``XeXpYd-shared`` (encode on its prefill worker's devices, a name serve does
    not take). Raises ValueError for a budget below 1."""
    if budget < 1:
        raise ValueError(f"device budget {budget}: must be at least 1")
    sizes = [s for s in platform.worker_sizes if s <= budget]
    out = []
    for s in sizes:
        if budget % s == 0:
            n = budget // s
            name = "colocated" if n == 1 else f"colocated-{n}{tp_suffix(s, s)}"
            out.append(Deployment(name, (WorkerSpec("colocated", s, tp=1 if n == 1 else s),) * n))
    for sp in sizes:
        for sd in sizes:
            for x in range(1, budget // sp + 1):
                rest = budget - x * sp
                if rest >= sd and rest % sd == 0:
                    y = rest // sd
                    workers = (WorkerSpec("prefill", sp, tp=sp),) * x + (WorkerSpec("decode", sd, tp=sd),) * y
                    out.append(Deployment(f"{x}p{y}d{tp_suffix(sp, sd)}", workers))
    if not images:
        return out
    for pd in [d for d in out if d.mode == "pd"]:
        x = sum(w.role == "prefill" for w in pd.workers)
        y = len(pd.workers) - x
        tp = pd.name[len(f"{x}p{y}d"):]
        shared = tuple(WorkerSpec(w.role, w.devices, f"p{i}" if w.role == "prefill" else "", w.tp)
                       for i, w in enumerate(pd.workers))
        encoders = tuple(WorkerSpec("encode", w.devices, w.share) for w in shared if w.share)
        out.append(Deployment(f"{x}e{x}p{y}d{tp}-shared", encoders + shared))
    for e in range(1, budget - 1):  # encode workers of one device; xPyD on the rest
        out += [Deployment(f"{e}e{d.name}", (WorkerSpec("encode"),) * e + d.workers)
                for d in candidates(platform, budget - e) if d.mode == "pd"]
    return out


@dataclass
class Candidate:
    """``max_rate`` req/s with its result (at the lowest rate tried when none passed);
    ``unbounded``: passed every rate with the whole trace in flight; ``above``: the lowest failing
    rate tried above it, and its result."""

    deployment: Deployment
    max_rate: float | None
    result: dict | None
    points: list[dict]
    unbounded: bool = False
    above: tuple[float, dict] | None = None

    def row(self, platform: Platform) -> dict:
        """Throughput and cost only where it meets the SLOs."""
        d, r = self.deployment, self.result or {}
        devices = d.devices
        tok_s = r.get("output_throughput", 0.0) if self.max_rate else None
        cost = devices * platform.price_per_device_hour / (tok_s * 3600) * 1e6 if tok_s else None
        return {"name": d.name, "devices": devices, "max_goodput_rps": self.max_rate or 0.0,
                "goodput_per_device": (self.max_rate or 0.0) / devices, "unbounded": self.unbounded,
                "p50_ttft_ms": r.get("median_ttft_ms"), "p95_ttft_ms": r.get("p95_ttft_ms"),
                "p50_itl_ms": r.get("median_itl_ms"), "p95_itl_ms": r.get("p95_itl_ms"),
                "p95_tpot_ms": r.get("p95_tpot_ms"),
                "output_tok_s_per_device": tok_s and tok_s / devices, "usd_per_m_output_tokens": cost,
                "replay_copies": r.get("replay_copies"), "steady_state": r.get("steady_state"),
                "above_rate_rps": self.above and self.above[0],
                "above_steady_state": self.above and self.above[1].get("steady_state"),
                "above_slo_attainment": self.above and self.above[1]["slo_attainment"],
                **({"elastic": r["elastic"]} if "elastic" in r else {})}


def measure_rate(deployment: Deployment, platform: Platform, requests: list[workload.Request],
                 slos_ms: dict[str, float], rate: float, limits: EngineLimits, steady: bool = True,
                 seed: int = 0) -> dict:
    """The metrics at ``rate`` req/s: ``steady`` replays until the queue settles (``replay_copies``,
    ``steady_state``, ``in_flight``; ``slo_attainment`` 0 when it never settles), else the trace
    once as ``compare --sweep-rates`` sends it. Raises KVCapacityError, ValueError."""
    if not steady:
        retimed = retime(requests, rate, seed)
        sim = serve(deployment, platform, retimed, limits)
        result = metrics.compute(sim.results(range(len(retimed)))[0], slos_ms)
    else:
        run = replay.replay(deployment, platform, requests, rate, limits, seed)
        result = metrics.compute(run.records, slos_ms) if run.steady else {"slo_attainment": 0.0,
                                                                           "request_goodput": 0.0}
        result.update(replay_copies=run.copies, steady_state=run.steady, in_flight=run.in_flight[-1])
        sim = run.sim
    if sim.controller:
        result["elastic"] = sim.controller.report()
    return result


def evaluate(deployment: Deployment, platform: Platform, requests: list[workload.Request],
             slos_ms: dict[str, float], target: float, limits: EngineLimits,
             iters: int = 6, steady: bool = True, seed: int = 0, hint: float | None = None) -> Candidate:
    """Rates double from 0.01 req/s per device until one fails, then ``iters`` bisections.
    ``hint`` (req/s, another seed's goodput) starts on the same grid at or below half of it and
    steps down while failing: the slow low rates are skipped, the bracket unchanged."""
    cache: dict[float, dict] = {}

    def measure(rate: float) -> dict:
        if rate not in cache:
            cache[rate] = measure_rate(deployment, platform, requests, slos_ms, rate, limits, steady, seed)
        return cache[rate]

    def ok(rate: float) -> bool:
        return measure(rate)["slo_attainment"] >= target

    base = lo = 0.01 * deployment.devices
    doublings = MAX_DOUBLINGS
    if hint and hint > 2 * base:
        k = min(MAX_DOUBLINGS, math.floor(math.log2(hint / 2 / base)))
        lo = base * 2 ** k  # a point of the grid: doubling is exact in floating point
        while lo > base and not ok(lo):
            lo /= 2
        doublings -= round(math.log2(lo / base))
    if not ok(lo):
        return Candidate(deployment, None, measure(lo), [], above=(lo, measure(lo)))
    hi = lo * 2
    for _ in range(doublings):
        if not ok(hi):
            break
        lo, hi = hi, hi * 2
    else:
        points = [{"rate": rate, "slo_attainment": r["slo_attainment"]} for rate, r in sorted(cache.items())]
        return Candidate(deployment, lo, measure(lo), points, unbounded=True)
    sweep = find_max_goodput_rate(measure, target, lo, hi, iters, progress=False)
    rate, failed = sweep["bracket"]
    return Candidate(deployment, rate, measure(rate) if rate else None, sweep["points"],
                     above=(failed, measure(failed)))


def evaluate_seeds(deployment: Deployment, platform: Platform, requests: list[workload.Request],
                   slos_ms: dict[str, float], target: float, limits: EngineLimits, seeds: list[int],
                   steady: bool = True) -> list[Candidate]:
    """One :func:`evaluate` per seed (the Poisson seed of a trace sent all at once), the
    first's goodput hinting the others. Raises KVCapacityError, ValueError."""
    first = evaluate(deployment, platform, requests, slos_ms, target, limits, steady=steady, seed=seeds[0])
    return [first] + [evaluate(deployment, platform, requests, slos_ms, target, limits, steady=steady, seed=s,
                               hint=first.max_rate) for s in seeds[1:]]


# Figures seed_row gives as medians over the arrival seeds, with a band.
HEADLINE = ("max_goodput_rps", "goodput_per_device", "p50_ttft_ms", "p95_ttft_ms", "p50_itl_ms", "p95_itl_ms",
            "p95_tpot_ms", "output_tok_s_per_device", "usd_per_m_output_tokens")


def median_index(cands: list[Candidate]) -> int:
    """The (lower) median goodput's index (none passing counts 0); ties to the earlier seed."""
    order = sorted(range(len(cands)), key=lambda i: (cands[i].max_rate or 0.0, i))
    return order[(len(cands) - 1) // 2]


def seed_row(cands: list[Candidate], platform: Platform, seeds: list[int]) -> dict:
    """Each :data:`HEADLINE` figure the median over seeds at each seed's own goodput, with
    ``per_seed`` and ``seed_band`` ([min, max]); ``median_seed``'s replay fills the other fields."""
    rows = [c.row(platform) for c in cands]
    m = median_index(cands)
    row = dict(rows[m], seeds=list(seeds), median_seed=seeds[m], unbounded=any(r["unbounded"] for r in rows))
    row["per_seed"], row["seed_band"] = {}, {}
    for key in HEADLINE:
        values = [r[key] for r in rows]
        present = [v for v in values if v is not None]
        row[key] = float(np.median(present)) if present else None
        row["per_seed"][key] = values
        row["seed_band"][key] = [min(present), max(present)] if present else None
    return row


def _per_device_band(row: dict) -> list[float] | None:
    band = row.get("goodput_band_rps")
    return band and [rate / row["devices"] for rate in band]


def _band(row: dict) -> str:
    return "{:.3g}–{:.3g}".format(*_per_device_band(row))


def _overlap(a: dict, b: dict) -> bool:
    """Bands of goodput per device at step times ± the platform's uncertainty; False without."""
    x, y = _per_device_band(a), _per_device_band(b)
    return bool(x and y) and x[0] <= y[1] and y[0] <= x[1]


def _is_colocated(row: dict) -> bool:
    return row["name"].startswith("colocated")


def _is_split(row: dict) -> bool:
    # An elastic deployment is neither: its workers are colocated or split as it goes.
    return not row["name"].startswith(("colocated", "elastic"))


def _seed_band(row: dict) -> list[float] | None:
    """[min, max] req/s per device over two or more seeds, else None."""
    band = (row.get("seed_band") or {}).get("goodput_per_device")
    return band if band and len(row.get("seeds") or ()) > 1 else None


def split_vs_colocated(rows: list[dict]) -> dict | None:
    """Whether the best split and best colocated rows' seed bands overlap (closed
    intervals); None without a feasible row of each or without bands of two seeds."""
    feasible = [r for r in rows if r["max_goodput_rps"] > 0]
    colo, split = [r for r in feasible if _is_colocated(r)], [r for r in feasible if _is_split(r)]
    if not colo or not split:
        return None
    bc = max(colo, key=lambda r: r["goodput_per_device"])
    bs = max(split, key=lambda r: r["goodput_per_device"])
    x, y = _seed_band(bc), _seed_band(bs)
    if not x or not y:
        return None
    overlap = x[0] <= y[1] and y[0] <= x[1]
    return {"colocated": bc["name"], "split": bs["name"], "bands": {bc["name"]: x, bs["name"]: y},
            "seeds": min(len(bc["seeds"]), len(bs["seeds"])), "overlap": overlap,
            "verdict": "cannot tell apart at this load" if overlap else "told apart"}


def _bands_text(v: dict) -> str:
    bands = ", ".join("{} {:.3g}–{:.3g}".format(name, *band) for name, band in v["bands"].items())
    return f"goodput per device over {v['seeds']} arrival seeds, min–max: {bands} req/s"


def recommend(rows: list[dict]) -> tuple[dict | None, str]:
    """(best row or None, why): the highest goodput per device; within 5 % a colocated one,
    then the cheapest per output token; a split never over colocated when their seed bands overlap.
    None when nothing passes, or several pass every rate tried (the trace is too short)."""
    feasible = [r for r in rows if r["max_goodput_rps"] > 0]
    if not feasible:
        return None, ("no deployment meets the SLOs for the target share of requests even at "
                      "the lowest rate tried; relax the SLOs or use faster hardware")
    unbounded = [r["name"] for r in feasible if r.get("unbounded")]
    if len(unbounded) > 1:
        return None, (f"{', '.join(unbounded)} meet the SLOs even with the whole trace in flight at once, so "
                      f"they cannot be ranked: plan with more requests")
    best = max(r["goodput_per_device"] for r in feasible)
    close = [r for r in feasible if r["goodput_per_device"] >= 0.95 * best]
    pick = min(close, key=lambda r: (not _is_colocated(r), r["usd_per_m_output_tokens"] or 0))
    verdict = split_vs_colocated(rows)
    if verdict and verdict["overlap"] and _is_split(pick):
        pick = next(r for r in feasible if r["name"] == verdict["colocated"])
    top = max(feasible, key=lambda r: r["goodput_per_device"])
    colo = [r for r in feasible if _is_colocated(r)]
    split = [r for r in feasible if _is_split(r)]
    why = f"{pick['name']} sustains {pick['max_goodput_rps']:.3g} req/s within the SLOs " \
          f"({pick['goodput_per_device']:.3g} req/s per device" + (
              f", medians over {len(pick['seeds'])} arrival seeds" if len(pick.get("seeds") or ()) > 1 else "") + ")"
    if pick is not top and any(pick is r for r in close):
        simpler = _is_colocated(pick) and not _is_colocated(top)
        why += (f", within 5 % of the best ({top['name']}, {top['goodput_per_device']:.3g}) and "
                + ("colocated, which is simpler to run" if simpler else "cheaper per output token"))
    if colo and split:
        bc = max(colo, key=lambda r: r["goodput_per_device"])
        bs = max(split, key=lambda r: r["goodput_per_device"])
        ratio = bs["goodput_per_device"] / bc["goodput_per_device"] if bc["goodput_per_device"] else float("inf")
        why += (f"; the best split ({bs['name']}) gives {ratio:.2f}x the goodput per device of the "
                f"best colocated ({bc['name']})")
        if ratio < 1.05:
            why += ": splitting does not pay off for this workload"
        if verdict and verdict["overlap"]:
            why += (f"; {bc['name']} vs {bs['name']}: cannot tell apart at this load: bands overlap "
                    f"({_bands_text(verdict)}); the simpler, colocated, is preferred")
        elif verdict:
            why += f"; {bc['name']} vs {bs['name']}: told apart, their bands do not overlap ({_bands_text(verdict)})"
        if _overlap(bc, bs):
            why += (f"; their goodput bands overlap ({bc['name']} {_band(bc)}, {bs['name']} {_band(bs)} req/s "
                    f"per device) with every step as much faster or slower as the calibration is uncertain, so "
                    f"the prediction cannot tell them apart: measure both with `epdserve compare`")
    elif split and not colo:
        why += "; no colocated deployment meets the SLOs at all"
    return pick, why
