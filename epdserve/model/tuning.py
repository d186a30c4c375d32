"""Choices the engine makes by timing alternatives on this machine (the block kernel / BLAS
cut-over, ``cutover.py``), measured so that a busy moment does not decide them for good, and
kept per machine.

An attempt times every candidate once per round, the candidates in turn, over :data:`ROUNDS`
rounds after an untimed one, so that load that comes and goes falls on all of them alike. It
is *disturbed* when

* other processes (or the hypervisor, as steal) took :data:`epdserve.host.OUTSIDE_SHARE_WARN`
  or more of the time of this process's cores while it ran (``/proc/stat`` against this
  process's CPU time: what ``compare`` checks for a run), or
* the choice made from each candidate's median time differs from the one made from its
  best: the repeats disagree about the answer.

A disturbed attempt is measured again, up to :data:`ATTEMPTS` attempts. The first clean one
decides and is kept in ``<cache>/tuning/<name>/<key>.json`` (its times, medians, load and the
machine it ran on); later processes read it. When every attempt was disturbed the choice is
made from each candidate's best time over all of them and kept *marked disturbed*: each later
start measures once more (one attempt, not :data:`ATTEMPTS`: a busy machine pays little at
every start), pools its best times with the kept ones, and replaces the entry with a clean
measurement as soon as it gets one. So a busy answer is never taken as final, and it gets
better with every start. An entry is keyed by the machine (CPU model and feature flags,
torch's version, the kernels' build, the engine's thread count) and the choice's own key
(the layers' shapes and formats); an unreadable one or one of another format version is
measured again and replaced, and so is any with ``force`` (``epdserve tune``). Processes
starting together measure once: the others wait on a lock.
"""

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
    """A measured choice: ``value``; ``source``: :data:`CACHE` (a clean measurement kept
    earlier), :data:`MEASURED` (measured now, clean, kept) or :data:`DISTURBED` (measured
    now and disturbed, as every one before it: kept marked so); ``path``: its cache file."""

    value: int | str
    source: str
    path: Path

    def as_json(self) -> dict:
        """``{"value", "source"}`` (a worker's /health entry)."""
        return {"value": self.value, "source": self.source}


@dataclass(frozen=True)
class Attempt:
    """One attempt's seconds per candidate and round (``times``), and the shares of its cores'
    time that other processes (``outside_share``) and the hypervisor (``steal_share``) took
    while it ran (None where ``/proc/stat`` cannot be read)."""

    times: dict[str, list[float]]
    outside_share: float | None
    steal_share: float | None

    def best(self) -> dict[str, float]:
        return {c: min(ts) for c, ts in self.times.items()}

    def median(self) -> dict[str, float]:
        return {c: statistics.median(ts) for c, ts in self.times.items()}

    def loaded(self) -> bool:
        """Whether other processes or steal took :data:`host.OUTSIDE_SHARE_WARN` or more."""
        return (self.outside_share or 0.0) + (self.steal_share or 0.0) >= host.OUTSIDE_SHARE_WARN


def machine() -> dict:
    """What a measured choice depends on besides its own key: ``{"cpu", "flags" (a digest of
    the sorted feature flags), "torch", "kernels" (their build digest), "threads"}``."""
    flags = " ".join(sorted(kernels.cpu_flags())).encode()
    return {"cpu": kernels.cpu_model(),
            "flags": hashlib.sha256(flags).hexdigest()[:12], "torch": torch.__version__,
            "kernels": kernels.digest(), "threads": torch.get_num_threads()}


def time_rounds(candidates: Mapping[str, Callable[[], object]], rounds: int = ROUNDS) -> Attempt:
    """Time each of ``candidates`` once per round, in turn, over ``rounds`` rounds after an
    untimed one; with the outside load on this process's cores over the timed rounds."""
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
    """The choice ``name`` for ``key`` on this machine: ``decide(seconds per candidate)`` of a
    clean attempt of ``measure()``, read from the cache when a clean one was kept before
    (unless ``force``); else from the best times of every disturbed attempt so far (see the
    module doc). ``valid(value)``: whether a kept value is one ``decide`` can give (an entry
    with another is measured again and replaced, as an unreadable one)."""
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
    """The entry at ``path``, or None: missing, or (with a log line) unreadable, of another
    version, or holding a value that is not ``valid`` or best times that are not numbers."""
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
    """Keep ``value`` with the ``best`` seconds per candidate it was decided from and the last
    attempt's medians and load."""
    entry = {"version": VERSION, **parts, "value": value, "disturbed": disturbed, "attempts": attempts,
             "outside_share": last.outside_share, "steal_share": last.steal_share,
             "best_ms": {c: t * 1e3 for c, t in best.items()},
             "median_ms": {c: t * 1e3 for c, t in last.median().items()},
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entry, indent=1))
    tmp.rename(path)
