"""Goodput sweep: the highest request rate a server sustains within its SLOs.

DistServe (Zhong et al., OSDI 2024, §2 and §5) defines a system's goodput as the highest
request rate at which at least a target share (e.g. 90 %) of requests meet every SLO
(TTFT, TPOT, ...), and finds it by searching over the rate. :func:`find_max_goodput_rate`
does that search by bisection, given a ``measure(rate)`` callable that runs one benchmark
at ``rate`` req/s and returns its result dict (:func:`epdserve.bench.run.bench` with SLOs
set); the share meeting every SLO is the result's ``slo_attainment``
(:func:`epdserve.bench.metrics.compute`).

Bisection assumes attainment falls as the rate rises (a loaded server only gets slower);
a noisy measurement can break that, which is why every measured point is returned, not
just the answer.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from epdserve import extras


class SweepError(ValueError):
    """Bad sweep settings (rates, target, iterations); the message names the value."""


def _point(rate: float, result: dict) -> dict:
    """One bench result without its per-request arrays, plus ``rate``."""
    if "slo_attainment" not in result or result["slo_attainment"] is None:
        raise SweepError("measure(rate) must return a result computed with SLOs "
                         "(no 'slo_attainment' in it)")
    point = {"rate": rate}
    point.update({k: v for k, v in result.items() if not isinstance(v, list)})
    return point


def find_max_goodput_rate(measure: Callable[[float], dict], target_share: float = 0.9,
                          lo: float = 0.5, hi: float = 8.0, iters: int = 5,
                          progress: bool = True) -> dict:
    """Bisect on request rate (req/s) for the highest rate whose SLO attainment is at least
    ``target_share``.

    ``measure(rate)`` runs the workload at ``rate`` req/s and returns a bench result dict
    holding ``slo_attainment`` (share of requests meeting every SLO, 0..1) and the usual
    ``request_throughput`` / ``request_goodput`` (req/s). ``lo`` and ``hi`` are measured
    first; then ``iters`` midpoints of the bracket [last passing rate, first failing rate].
    So the answer is within (hi - lo) / 2**iters req/s of the true crossing, if
    attainment falls monotonically with rate.

    Returns ``{"max_rate": float | None, "target_share": ..., "bracket": [pass, fail],
    "points": [...]}``: ``max_rate`` is the highest measured rate that met the target
    (``hi`` when even ``hi`` meets it: the search range was too low; None when not even
    ``lo`` does); ``points`` are all measured rates sorted by rate, each its result
    without the per-request arrays, plus ``rate``.

    Raises:
        SweepError: 0 < lo < hi finite, 0 < target_share <= 1 and iters >= 0 are not met,
            or a result has no ``slo_attainment``.
    """
    if not (0 < lo < hi) or math.isinf(hi):
        raise SweepError(f"sweep rates {lo}:{hi}: need 0 < LO < HI, both finite (req/s)")
    if not (0 < target_share <= 1):
        raise SweepError(f"goodput target {target_share}: must be in (0, 1]")
    if iters < 0:
        raise SweepError(f"sweep iterations {iters}: must be >= 0")
    points: list[dict] = []
    bar = tqdm(total=2 + iters, desc="sweep", unit="rate", disable=not progress)

    def passes(rate: float) -> bool:
        bar.set_postfix(rate=f"{rate:.3g}")
        point = _point(rate, measure(rate))
        points.append(point)
        bar.update(1)
        return point["slo_attainment"] >= target_share

    try:
        if not passes(lo):
            good, bad = None, lo
        elif passes(hi):
            good, bad = hi, None
        else:
            good, bad = lo, hi
            for _ in range(iters):
                mid = (good + bad) / 2
                if passes(mid):
                    good = mid
                else:
                    bad = mid
    finally:
        bar.close()
    return {"max_rate": good, "target_share": target_share, "bracket": [good, bad],
            "points": sorted(points, key=lambda p: p["rate"])}


def plot(sweep: dict, path: str | Path) -> Path | None:
    """Draw request throughput and goodput (req/s, left axis) and SLO attainment (right
    axis, with the target as a dashed line) against the offered rate; write a PNG to
    ``path`` and return it (None, after one warning line, without matplotlib). ``sweep`` is
    a :func:`find_max_goodput_rate` result."""
    try:
        plt = extras.pyplot()
    except extras.MissingExtra as exc:
        extras.warn_skipped(exc)
        return None
    pts = sweep["points"]
    rates = [p["rate"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(rates, [p["request_throughput"] for p in pts], "o-", label="request throughput")
    ax.plot(rates, [p["request_goodput"] for p in pts], "s-", label="request goodput")
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("req/s")
    ax2 = ax.twinx()
    ax2.plot(rates, [p["slo_attainment"] for p in pts], "^:", color="tab:red",
             label="SLO attainment")
    ax2.axhline(sweep["target_share"], color="tab:red", linestyle="--", linewidth=0.8)
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("share of requests meeting every SLO")
    if sweep["max_rate"] is not None:
        ax.axvline(sweep["max_rate"], color="grey", linestyle="--", linewidth=0.8)
    title = (f"max goodput rate {sweep['max_rate']:.3g} req/s" if sweep["max_rate"] is not None
             else "no rate met the target")
    ax.set_title(f"{title} (target {sweep['target_share']:.0%} within SLOs)")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    # Below the axes: the curves cross every corner of the plot.
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper center",
              bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
