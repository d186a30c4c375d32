"""A saved comparison judged again against other SLOs from its per-request outcomes
(``per_run``): what compare would have computed with those SLOs."""

from __future__ import annotations

import statistics

from epdserve.bench import metrics, paired


class SavedRunError(ValueError):
    """Names the entry and what it lacks."""


def check(entries: list[dict], slos_ms: dict[str, float]) -> None:
    """Raises SavedRunError for an entry that ran without ``per_run`` or without a value an SLO
    needs (saved by an older epdserve), and ValueError for an unknown SLO key or one <= 0 ms."""
    metrics.check_slos(slos_ms)
    for key, ms in slos_ms.items():
        if not ms > 0:
            raise ValueError(f"SLO {key}:{ms:g}: an SLO must be above 0 ms")
    for e in entries:
        if "result" not in e:
            continue
        if not e.get("per_run"):
            raise SavedRunError(f"configuration {e['name']!r} has no per-request outcomes (per_run): saved by an "
                                "older epdserve, or its runs kept no per-request arrays")
        missing = sorted({paired.SLO_VALUES[k] for k in slos_ms} - set(e["per_run"][0]))
        if missing:
            raise SavedRunError(f"configuration {e['name']!r} keeps no per-request {', '.join(missing)} (saved by an "
                                "older epdserve): it cannot be judged against those SLOs")


def judge_run(outcome: dict, slos_ms: dict[str, float]) -> dict:
    """``good``: completed and within every SLO."""
    columns = [outcome[paired.SLO_VALUES[k]] for k in slos_ms]
    good = [all(v is not None and v <= ms for v, ms in zip(values, slos_ms.values()))
            for values in zip(*columns)] if columns else [ttft is not None for ttft in outcome["ttft_ms"]]
    return {**outcome, "good": good, "slos_ms": dict(slos_ms)}


def judge_entry(entry: dict, slos_ms: dict[str, float], default: bool = False) -> dict:
    """Goodput and attainment become the medians over the judged runs (with [min, max] in
    ``spread``), as repeats.combine folds them; an entry that did not run comes back as it is."""
    if "result" not in entry:
        return entry
    runs = [judge_run(o, slos_ms) for o in entry["per_run"]]
    goodputs = [sum(r["good"]) / r["duration_s"] if r["duration_s"] > 0 else 0.0 for r in runs]
    attainments = [sum(r["good"]) / len(r["good"]) if r["good"] else 0.0 for r in runs]
    result = {**entry["result"], "request_goodput": statistics.median(goodputs),
              "slo_attainment": statistics.median(attainments), "goodput_slos_ms": dict(slos_ms),
              "goodput_slos_default": default}
    spread = entry.get("spread")
    if spread is not None:
        spread = {**spread, "request_goodput": [min(goodputs), max(goodputs)],
                  "slo_attainment": [min(attainments), max(attainments)]}
    return {**entry, "result": result, "per_run": runs, "spread": spread}


def judge(entries: list[dict], slos_ms: dict[str, float], default: bool = False) -> list[dict]:
    """Raises SavedRunError, ValueError as :func:`check`."""
    check(entries, slos_ms)
    return [judge_entry(e, slos_ms, default) for e in entries]
