"""Choices made by timing alternatives on this machine, kept in ``<cache>/tuning/<name>/<key>.json``
(keyed by CPU model and flags, torch, kernel build, threads and the choice's key; processes starting
together wait on a lock). An attempt is :data:`ROUNDS` rounds after an untimed one; it is disturbed if
outside load reached :data:`host.OUTSIDE_SHARE_WARN` or median and best times disagree. Up to
:data:`ATTEMPTS` attempts; if all are disturbed the pooled best times decide and the entry is kept marked
disturbed: each later start measures once more until a clean attempt replaces it. ``force``: measure again."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from epdserve import host
from epdserve.model import kernels
from epdserve.model.base import cache_root

log = logging.getLogger(__name__)

ROUNDS = 3  # timed rounds per attempt, after one untimed
ATTEMPTS = 3  # attempts at a first start before a choice is kept marked disturbed
VERSION = 2  # of the entries' format: entries of another version are measured again

# Where a choice came from (its /health "source").
CACHE, MEASURED, DISTURBED = "cache", "measured", "disturbed"


@dataclass(frozen=True)
class Tuned:
    """``source``: :data:`CACHE`, :data:`MEASURED` (now, clean) or :data:`DISTURBED`; ``path``: its cache file."""

    value: int | str
    source: str
    path: Path

    def as_json(self) -> dict:
        return {"value": self.value, "source": self.source}


@dataclass(frozen=True)
class Attempt:
    """Seconds per candidate and round; the load shares are None where ``/proc/stat`` is unreadable."""

    times: dict[str, list[float]]
    outside_share: float | None
    steal_share: float | None

    def best(self) -> dict[str, float]:
        return {c: min(ts) for c, ts in self.times.items()}

    def median(self) -> dict[str, float]:
        return {c: statistics.median(ts) for c, ts in self.times.items()}

    def loaded(self) -> bool:
        return (self.outside_share or 0.0) + (self.steal_share or 0.0) >= host.OUTSIDE_SHARE_WARN


def machine() -> dict:
    """The cache key besides the choice's own (``flags``: a digest of the sorted CPU flags)."""
    flags = " ".join(sorted(kernels.cpu_flags())).encode()
    return {"cpu": kernels.cpu_model(),
            "flags": hashlib.sha256(flags).hexdigest()[:12], "torch": torch.__version__,
            "kernels": kernels.digest(), "threads": torch.get_num_threads()}


def time_rounds(candidates: Mapping[str, Callable[[], object]], rounds: int = ROUNDS) -> Attempt:
    for fn in candidates.values():
        fn()
    cores = sorted(os.sched_getaffinity(0))
    try:
        before = host.cpu_ticks(cores)
    except OSError:
        before = None
    own0 = time.process_time()
    times: dict[str, list[float]] = {c: [] for c in candidates}
    for _ in range(rounds):
        for c, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[c].append(time.perf_counter() - t0)
    if before is None:
        return Attempt(times, None, None)
    _, _, outside, steal = host.cpu_shares(before, host.cpu_ticks(cores), time.process_time() - own0)
    return Attempt(times, outside, steal)


def choose(name: str, key: Sequence, measure: Callable[[], Attempt],
           decide: Callable[[Mapping[str, float]], int | str], valid: Callable[[object], bool],
           force: bool = False) -> Tuned:
    """``decide(seconds per candidate)`` as the module doc says; ``valid``: whether a kept value is acceptable."""
    parts = {"machine": machine(), "key": list(key)}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_root() / "tuning" / name / f"{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = None if force else _read(path, valid)
        if kept is not None and not kept["disturbed"]:
            return Tuned(kept["value"], CACHE, path)
        # Disturbed before: one more attempt a start, pooled with the best times kept.
        pooled = {c: ms / 1e3 for c, ms in kept["best_ms"].items()} if kept else {}
        for attempt in range(1, (1 if kept else ATTEMPTS) + 1):
            a = measure()
            value = decide(a.best())
            if not a.loaded() and decide(a.median()) == value:
                _write(path, parts, value, a.best(), a, attempt, disturbed=False)
                log.info("%s: %s (measured on %d threads, attempt %d; kept in %s)", name, value,
                         torch.get_num_threads(), attempt, path)
                return Tuned(value, MEASURED, path)
            pooled = {c: min(t, pooled.get(c, t)) for c, t in a.best().items()}
        value, attempts = decide(pooled), attempt + (kept["attempts"] if kept else 0)
        _write(path, parts, value, pooled, a, attempts, disturbed=True)
        log.warning("%s: %s, from the best times of %d disturbed measurements (other processes took %s of the "
                    "cores in the last, or the repeats disagreed): kept as disturbed, measured again at the next "
                    "start until a quiet one replaces it", name, value, attempts, f"{a.outside_share or 0:.0%}")
        return Tuned(value, DISTURBED, path)


def _read(path: Path, valid: Callable[[object], bool]) -> dict | None:
    """None if missing, unreadable, of another version or invalid (logged)."""
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable (%s); measuring again", path, exc)
        return None
    ok = (isinstance(entry, dict) and entry.get("version") == VERSION and isinstance(entry.get("disturbed"), bool)
          and valid(entry.get("value")) and isinstance(entry.get("attempts"), int)
          and isinstance(entry.get("best_ms"), dict)
          and all(isinstance(t, (int, float)) and t >= 0 for t in entry["best_ms"].values()))
    if not ok:
        log.warning("%s: not an entry of this version with a valid value; measuring again", path)
        return None
    return entry


def _write(path: Path, parts: dict, value: int | str, best: Mapping[str, float], last: Attempt, attempts: int,
           disturbed: bool) -> None:
    entry = {"version": VERSION, **parts, "value": value, "disturbed": disturbed, "attempts": attempts,
             "outside_share": last.outside_share, "steal_share": last.steal_share,
             "best_ms": {c: t * 1e3 for c, t in best.items()},
             "median_ms": {c: t * 1e3 for c, t in last.median().items()},
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entry, indent=1))
    tmp.rename(path)
