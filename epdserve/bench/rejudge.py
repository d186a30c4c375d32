"""A saved comparison judged again against other SLOs, without running anything.

Each compare entry keeps every run's per-request outcomes (``per_run``,
:func:`epdserve.bench.paired.outcomes`): the value of every SLO key for every request (TTFT,
TPOT, E2EL, longest ITL gap, ITL p99; None for a failed request). Judging them against other
SLOs gives what compare would have computed had it been run with them: each request within
the SLOs or not, each run's goodput (within / the run's duration) and attainment (within /
all requests), the entry's figures as the median over its runs and their range. The
recommendation (:func:`epdserve.bench.recommend.recommend`) then reads the judged entries
as it reads compare's.
"""

from __future__ import annotations

import statistics

from epdserve.bench import metrics, paired


class SavedRunError(ValueError):
    """A saved comparison that cannot be judged again (its message names the entry and what
    it lacks)."""


def check(entries: list[dict], slos_ms: dict[str, float]) -> None:
    """That every entry that ran keeps, for every run, the per-request values ``slos_ms``
    bound.

    Raises:
        SavedRunError: an entry without ``per_run`` (saved by a version that did not keep
            them, or a result without per-request arrays) or whose runs lack a value an SLO
            key needs (saved before that value was kept).
        ValueError: an SLO key not in :data:`metrics.SLO_METRICS` or an SLO of 0 ms or below.
    """
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
    """One run's outcomes with ``good`` judged against ``slos_ms``: completed (a value is
    kept) and within every SLO."""
    columns = [outcome[paired.SLO_VALUES[k]] for k in slos_ms]
    good = [all(v is not None and v <= ms for v, ms in zip(values, slos_ms.values()))
            for values in zip(*columns)] if columns else [ttft is not None for ttft in outcome["ttft_ms"]]
    return {**outcome, "good": good, "slos_ms": dict(slos_ms)}


def judge_entry(entry: dict, slos_ms: dict[str, float], default: bool = False) -> dict:
    """``entry`` judged against ``slos_ms`` (``default``: they are the default SLOs, as the
    recommendation words it): ``per_run`` judged again, and the result's ``request_goodput``
    and ``slo_attainment`` the medians over the runs (their [min, max] in ``spread`` with
    several runs), as :func:`epdserve.bench.repeats.combine` folds them. An entry that did
    not run comes back as it is."""
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
    """Every entry judged against ``slos_ms`` (:func:`judge_entry`), after :func:`check`.

    Raises:
        SavedRunError, ValueError: as :func:`check`.
    """
    check(entries, slos_ms)
    return [judge_entry(e, slos_ms, default) for e in entries]
