"""How many times compare runs each deployment, interleaved in rounds (A B, A B: a drift hits
each alike): ``--repeats N``, or ``auto`` until the paired verdict is settled over
:data:`MIN_ROUNDS`, overload, :data:`MAX_ROUNDS`, or ``--budget`` (docs/comparing.md)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from epdserve.bench import recommend, repeats

AUTO = "auto"
MIN_ROUNDS = 2  # one round's interval covers its requests, not the drift between runs
MAX_ROUNDS = 10
DEFAULT_BUDGET_MIN = 15.0


def parse_repeats(text: str) -> int | str:
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
    """``run_one(dep, progress)`` returns an entry; returns (each deployment's runs, why the
    rounds stopped, one sentence)."""
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
    """(the verdict's state in words, who runs next: all while unsettled or under
    :data:`MIN_ROUNDS`, else those whose every run was flagged)."""
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
