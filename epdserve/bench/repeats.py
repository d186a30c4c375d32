"""Repeated runs of one deployment folded into one compare entry: the median of each figure
(one disturbed run does not move it) and its [min, max]; the layout is in docs/comparing.md,
"compare.json entries"."""

from __future__ import annotations

from collections import Counter

import numpy as np

from epdserve.bench import metrics, paired

# Per-request arrays kept from the first run, for the plots and the report.
PLOT_ARRAYS = ("ttfts", "itls", "errors", "start_offsets", "kinds")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars(result: dict) -> dict:
    """Numbers and None of a bench result, with goodput as the comparison judges it."""
    out = {k: v for k, v in result.items() if v is None or _number(v)}
    judged = metrics.judged_goodput(result)
    out.update(request_goodput=judged["request_goodput"],
               slo_attainment=judged["slo_attainment"])
    return out


def medians(dicts: list[dict]) -> tuple[dict, dict[str, list]]:
    """(median, [min, max]) per numeric key, None values left out; a whole median of ints
    stays an int."""
    keys = dict.fromkeys(k for d in dicts for k in d)
    med, spread = {}, {}
    for k in keys:
        values = [d[k] for d in dicts if _number(d.get(k))]
        if not values:
            med[k] = None
            continue
        m = float(np.median(values))
        med[k] = int(m) if all(isinstance(v, int) for v in values) and m.is_integer() else m
        spread[k] = [min(values), max(values)]
    return med, spread


def _most_disturbed(runs: list[dict]) -> dict | None:
    loads = [r["host_load"] for r in runs if r.get("host_load")]
    return max(loads, key=lambda h: h["during"]["outside_share"], default=None)


def combine(runs: list[dict]) -> dict:
    """One entry from ``runs`` of ONE deployment (failed ones ``{"name", "mode", "error"}``), in
    run order; flagged runs are left out when an unflagged one completed; all failed: the first
    failure.

    Raises ValueError: no runs, or runs of several deployments."""
    if not runs:
        raise ValueError("combine: no runs to combine")
    names = sorted({r["name"] for r in runs})
    if len(names) > 1:
        raise ValueError(f"combine: runs of several deployments {names}; combine one at a time")
    done = [r for r in runs if "result" in r]
    failed = [r["error"] for r in runs if "result" not in r]
    if not done:
        return {**runs[0], "error": runs[0]["error"] + (f" (all {len(runs)} runs failed)"
                                                        if len(runs) > 1 else "")}
    flagged = [r for r in done if flagged_by_load(r)]
    used = [r for r in done if not flagged_by_load(r)] or done
    if len(used) == 1:
        entry = {**used[0], "runs": [scalars(used[0]["result"])], "spread": None}
    else:
        entry = _fold(used)
    if all("ttfts" in r["result"] for r in used):
        entry["per_run"] = [paired.outcomes(r["result"]) for r in used]
    if failed:
        entry["failed_runs"] = failed
    if flagged and len(used) < len(done):
        entry["flagged_runs"] = [r["host_load"]["warning"] for r in flagged]
    return entry


def flagged_by_load(run: dict) -> bool:
    return bool((run.get("host_load") or {}).get("warning"))


def _fold(done: list[dict]) -> dict:
    first = done[0]["result"]
    per_run = [scalars(r["result"]) for r in done]
    result, spread = medians(per_run)
    result.update({k: v for k, v in first.items() if not (v is None or _number(v))
                   and not isinstance(v, list)})  # settings, SLOs: the same in every run
    result.update({k: first[k] for k in PLOT_ARRAYS if k in first})
    judged = metrics.judged_goodput(first)
    result.update(goodput_slos_ms=judged["goodput_slos_ms"],
                  goodput_slos_default=judged["goodput_slos_default"])
    result["error_counts"] = dict(sum((Counter(r["result"].get("error_counts") or {})
                                       for r in done), Counter()).most_common())
    stalls, stalls_spread = medians([{"itl_stalls": r.get("itl_stalls")} for r in done])
    spread.update(stalls_spread)
    peaks = [r["memory_peak_bytes"] for r in done if r.get("memory_peak_bytes")]
    return {**done[0], "result": result, "itl_stalls": stalls["itl_stalls"],
            "memory_peak_bytes": max(peaks, default=None),
            "server": medians([r.get("server") or {} for r in done])[0],
            "host_load": _most_disturbed(done), "runs": per_run, "spread": spread}
