"""How many times compare runs each deployment: ``--repeats N``, or ``auto``: until the
verdict is clear or the time budget ends.

Runs are interleaved, one round at a time (A B, A B, ...: a drift of the machine hits every
deployment alike), each from a fresh start of the deployment. After each round of
``--repeats auto`` the deployments' runs are folded (:func:`repeats.combine`) and judged
(:func:`epdserve.bench.recommend.recommend`: ``settled``): it stops when every configuration is told apart from the goodput
leader or shown tied with it (the paired interval excludes zero, or lies within the tie
band) over at least :data:`MIN_ROUNDS` rounds (one round's interval covers its requests,
not a drift of the machine between runs), when every configuration is past its capacity
(overload: more runs of this load do not rank by goodput), after :data:`MAX_ROUNDS`
rounds, or when the next round would end after ``--budget`` minutes (estimated from the
last round's duration; the first round always runs). A run the load check flags (other processes on the cores) is left out of the
verdict (:func:`repeats.combine`); with ``auto``, a deployment whose every run was flagged
runs again while the budget allows, even once the rest is settled.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from epdserve.bench import recommend, repeats

AUTO = "auto"
MIN_ROUNDS = 2  # auto: the fewest rounds a clear verdict stops after, where the budget allows
MAX_ROUNDS = 10  # auto: the most rounds, whatever the budget
DEFAULT_BUDGET_MIN = 15.0


def parse_repeats(text: str) -> int | str:
    """argparse type for ``--repeats``: a positive integer or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer or 'auto'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer or 'auto'")
    return n


def run_rounds(chosen: list, run_one: Callable[[object, str], dict], repeats_opt: int | str,
               budget_min: float) -> tuple[dict[str, list[dict]], str]:
    """Run the deployments ``chosen`` (objects with a ``name``) in rounds; ``run_one(dep,
    progress)`` runs one and returns its entry (or a failed entry). Returns (each
    deployment's runs in order, why it stopped: one sentence for the report)."""
    runs: dict[str, list[dict]] = {dep.name: [] for dep in chosen}
    rounds = MAX_ROUNDS if repeats_opt == AUTO else repeats_opt
    deadline = time.monotonic() + budget_min * 60
    todo = list(chosen)
    for r in range(rounds):
        start = time.monotonic()
        for k, dep in enumerate(todo):
            tag = f"{r + 1}.{k + 1}/{len(todo)}" if repeats_opt == AUTO else f"{r * len(todo) + k + 1}/{rounds * len(todo)}"
            runs[dep.name].append(run_one(dep, tag))
        if repeats_opt != AUTO:
            continue
        entries = [repeats.combine(runs[dep.name]) for dep in chosen]
        why, todo = _next(chosen, entries, runs, r + 1)
        if not todo:
            return runs, f"--repeats auto stopped after {r + 1} round{'s' if r else ''}: {why}."
        took = time.monotonic() - start
        if time.monotonic() + took * len(todo) / max(len(chosen), 1) > deadline:
            return runs, (f"--repeats auto stopped after {r + 1} round{'s' if r else ''} at the budget "
                          f"(--budget {budget_min:g} min): another would take ~{took / 60:.1f} min; "
                          f"{why}.")
    if repeats_opt == AUTO:
        return runs, f"--repeats auto stopped after the most rounds ({MAX_ROUNDS})."
    return runs, f"--repeats {repeats_opt}: {repeats_opt} run{'s' if repeats_opt > 1 else ''} per configuration."


def _next(chosen: list, entries: list[dict], runs: dict[str, list[dict]], done: int) -> tuple[str, list]:
    """(the state of the verdict in words, the deployments to run next: all while the
    verdict is unsettled or, for a paired verdict, fewer than :data:`MIN_ROUNDS` of ``done``
    rounds ran, else those whose every run the load check flagged, else none)."""
    rec = recommend.recommend(entries)
    all_flagged = [dep for dep in chosen if runs[dep.name]
                   and all(repeats.flagged_by_load(x) for x in runs[dep.name] if "result" in x)
                   and any("result" in x for x in runs[dep.name])]
    if not rec["settled"]:
        return f"not yet told apart from the leader: {', '.join(rec['unsettled'])}", list(chosen)
    verdict = rec["verdict"] or "nothing ran"
    if done < MIN_ROUNDS and rec["comparison"] is not None:  # a paired verdict, not overloaded
        return (f"the verdict is clear ({verdict}) after {done} round, which covers its requests only, not "
                "the machine's drift between runs"), list(chosen)
    flagged = f"; the load check flagged every run of {', '.join(d.name for d in all_flagged)}" if all_flagged else ""
    return f"the verdict is clear ({verdict}){flagged}", all_flagged
