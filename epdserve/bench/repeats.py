"""Repeated runs of one deployment folded into one compare entry: the median of each figure
and its range over the runs.

One run of a few dozen requests is one sample: its p95 moves by tens of % from run to run
on a busy machine, so a verdict needs the spread. ``epdserve compare --repeats N`` runs the
deployments interleaved (A B A B ...: a drift of the machine hits every deployment alike)
and hands each deployment's N entries to :func:`combine`. The median, not the mean, so
that one disturbed run does not move the figure. The verdict does not read the medians: it
pairs the runs' per-request outcomes (``per_run``) with the other deployments'
(:mod:`epdserve.bench.paired`).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from epdserve.bench import metrics, paired

# The per-request arrays kept, from the first run: what the plots and the report read.
PLOT_ARRAYS = ("ttfts", "itls", "errors", "start_offsets", "kinds")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars(result: dict) -> dict:
    """The scalar figures of one bench result (numbers and None; no per-request arrays,
    settings or texts), with its goodput as the comparison judges it
    (:func:`metrics.judged_goodput`: the default SLOs when the run had none)."""
    out = {k: v for k, v in result.items() if v is None or _number(v)}
    judged = metrics.judged_goodput(result)
    out.update(request_goodput=judged["request_goodput"],
               slo_attainment=judged["slo_attainment"])
    return out


def medians(dicts: list[dict]) -> tuple[dict, dict[str, list]]:
    """(median, [min, max]) of each numeric key over ``dicts`` (missing or None values left
    out; a key with no number anywhere is None and has no range). A median of integers
    that is a whole number stays an int (counts such as ``completed``)."""
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
    """The host load of the run in which other processes took the largest share of the
    cores (its warning, if any, is the one to show), or None without one."""
    loads = [r["host_load"] for r in runs if r.get("host_load")]
    return max(loads, key=lambda h: h["during"]["outside_share"], default=None)


def combine(runs: list[dict]) -> dict:
    """One compare entry from ``runs``: N entries of ONE deployment, each as
    :func:`epdserve.bench.compare.run_config` returns it (or ``{"name", "mode", "error"}``
    for a run that failed), in the order they ran.

    Runs the load check flagged (:func:`flagged_by_load`) are left out when another
    run completed unflagged; ``flagged_runs`` then holds their warnings. The entry is the
    first run used, with:

    * ``result``: the median over the completed runs of each scalar of the bench result
      (ms, req/s, tok/s, counts), the goodput as judged against the default SLOs when the
      runs had none (:func:`metrics.judged_goodput`, ``goodput_slos_ms`` and
      ``goodput_slos_default`` set), settings from the first run, ``error_counts`` summed
      over the runs, and of the per-request arrays only :data:`PLOT_ARRAYS` of the first
      run (for the plots and the first error);
    * ``itl_stalls``: the median count; ``server``: the median of each number of the
      server-trace summary; ``memory_peak_bytes``: the highest of the runs'; ``host_load``: the
      most disturbed run's; ``breakdown`` and
      ``sweep``: the first run's;
    * ``runs``: each completed run's scalar results (:func:`scalars`);
    * ``spread``: ``{metric: [min, max]}`` over the completed runs for each number of
      ``result`` and ``itl_stalls``; None with one completed run (the spread is unknown);
    * ``per_run``: each run's per-request outcomes (:func:`paired.outcomes`), in order: what
      the verdict pairs with the other deployments' runs;
    * ``failed_runs``: the error of each run that failed, when one did.

    With one run used, the entry is that run as it is, plus ``runs`` and ``per_run`` of
    it and ``spread`` None. ``per_run`` is absent when a result has no per-request arrays. When every run failed, the first failure (with several runs, its error says
    that all failed).

    Raises:
        ValueError: ``runs`` is empty or holds entries of several deployments.
    """
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
    """True when the load check flagged a run (``host_load.warning``: other processes on the
    cores, a priority not matched, a late client)."""
    return bool((run.get("host_load") or {}).get("warning"))


def _fold(done: list[dict]) -> dict:
    """:func:`combine` for two or more completed runs."""
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
