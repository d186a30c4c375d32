"""Goodput sweep: the highest request rate at which a target share of requests meets every SLO
(DistServe, Zhong et al., OSDI 2024, §2 and §5), found by bisection on the rate. Bisection
assumes attainment falls as the rate rises; noise can break that, so every point is returned."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from epdserve import extras


class SweepError(ValueError):
    """Bad sweep settings; the message names the value."""


def _point(rate: float, result: dict) -> dict:
    if "slo_attainment" not in result or result["slo_attainment"] is None:
        raise SweepError("measure(rate) must return a result computed with SLOs "
                         "(no 'slo_attainment' in it)")
    point = {"rate": rate}
    point.update({k: v for k, v in result.items() if not isinstance(v, list)})
    return point


def find_max_goodput_rate(measure: Callable[[float], dict], target_share: float = 0.9,
                          lo: float = 0.5, hi: float = 8.0, iters: int = 5,
                          progress: bool = True) -> dict:
    """``measure(rate)`` (req/s) returns a bench result with ``slo_attainment``; ``lo`` and
    ``hi`` are measured, then ``iters`` midpoints: the answer is within (hi - lo) / 2**iters of
    the crossing.

    Returns ``{"max_rate", "target_share", "bracket": [pass, fail], "points"}``: ``max_rate``
    is ``hi`` when even it passes (raise it), None when ``lo`` fails.
    Raises SweepError: not 0 < lo < hi < inf, target not in (0, 1], iters < 0, or a result
    without ``slo_attainment``."""
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
    """Throughput and goodput (req/s) and attainment against the offered rate; the PNG's path,
    None (after one warning line) without matplotlib."""
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
