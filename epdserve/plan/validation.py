"""Simulating ``epdserve compare`` configurations: a name's deployment and scheduler settings,
predicted against measured metrics of compare runs (``plan validate``), and simulated against
measured SLO attainment at each rate of a goodput sweep."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from epdserve.bench import metrics, workload
from epdserve.plan import at_rate
from epdserve.plan.costmodel import Platform
from epdserve.plan.search import measure_rate
from epdserve.plan.sim_elastic import ElasticConfig, elastic_config
from epdserve.plan.simulate import Deployment, EngineLimits, WorkerSpec, check, serve
from epdserve.serving.deployment import ELASTIC_SLO_KEYS, DeploymentSpec
from epdserve.plan.serving_fit import compare_configs

VALIDATED = ("p95_ttft_ms", "p95_itl_ms", "output_throughput")
# Below saturation throughput follows the arrivals whatever the step times: its band says nothing.
BANDED = ("p95_ttft_ms", "p95_itl_ms")


def compare_deployment(name: str, cores: int, elastic: ElasticConfig | None = None) -> Deployment:
    """Placed by the launcher's rule, each worker with its role's TP ranks; workers on the
    same cores share them, partly overlapping ones get an ``overlap`` tag; an elastic name starts
    colocated on ``colocated-N``'s cores.

    Raises ValueError: an unknown name or count, ``pd-localN`` (not simulated), or a worker with
    more ranks than ``cores``."""
    spec = DeploymentSpec.parse(name)
    if spec.local_prefill_threshold is not None:
        raise ValueError(f"{name}: prefill of short prompts on the decode worker is not simulated")
    placed = spec.place(list(range(cores)))
    workers_on = Counter(tuple(cs) for _, _, cs in placed)
    groups = overlap_groups([set(cs) for cs in workers_on])
    workers = []
    for role, _, cs in placed:
        share = ",".join(map(str, cs)) if workers_on[tuple(cs)] > 1 else ""
        workers.append(WorkerSpec(role, len(cs), share, spec.role_tp(role), groups.get(tuple(cs), "")))
    return Deployment(name, tuple(workers), (elastic or elastic_config({})) if spec.elastic else None)


def overlap_groups(placements: list[set[int]]) -> dict[tuple[int, ...], str]:
    """An ``overlap`` tag (the group's sorted cores) per set of cores sharing some but not all
    of its cores with another."""
    groups: list[tuple[set[int], list[set[int]]]] = []  # (union of cores, placements)
    for p in placements:  # each joins, and so merges, every group its cores meet
        meeting = [g for g in groups if g[0] & p]
        groups = [g for g in groups if not g[0] & p]
        groups.append((set(p).union(*(cores for cores, _ in meeting)), [p, *(q for _, ps in meeting for q in ps)]))
    return {tuple(sorted(p)): ",".join(map(str, sorted(cores))) for cores, ps in groups if len(ps) > 1 for p in ps}


def compare_limits(name: str) -> EngineLimits:
    """serve's defaults but the name's step budget and prefix caching (unknown names: defaults)."""
    try:
        spec = DeploymentSpec.parse(name)
    except ValueError:
        return EngineLimits()
    limits = EngineLimits()
    if spec.chunked_prefill:
        limits = replace(limits, max_num_batched_tokens=spec.max_num_batched_tokens)
    if not spec.prefix_caching:
        limits = replace(limits, enable_prefix_caching=False)
    return limits


def validate(compare_dirs: list[Path], platform: Platform) -> tuple[list[dict], list[dict]]:
    """(rows, predictions as compare entries). Per :data:`VALIDATED` metric: ``measured`` (mean of
    ``runs``), ``error`` and ``spread`` relative to it, ``band`` (predictions at 1 ± step
    uncertainty) and ``in_band``. Raises ValueError when the runs replayed different traces."""
    requests = workload.load_trace(compare_dirs[0] / "trace.jsonl")
    for d in compare_dirs[1:]:
        if workload.load_trace(d / "trace.jsonl") != requests:
            raise ValueError(f"{d} replayed another trace than {compare_dirs[0]}; repeats of one "
                             f"workload are needed")
    results: dict[str, list[dict]] = {}
    cores: dict[str, int] = {}
    for d in compare_dirs:
        for entry in compare_configs(d):
            if "result" in entry:
                results.setdefault(entry["name"], []).append(entry["result"])
                cores[entry["name"]] = entry_cores(entry)
    rows, entries = [], []
    elastic = elastic_config(compare_slos(compare_dirs[0]))
    for name, runs in results.items():
        try:
            dep = compare_deployment(name, cores[name], elastic)
            check(dep, platform, requests, compare_limits(name))  # e.g. no model of its TP workers
        except ValueError as exc:
            print(f"skipped {name}: {exc}", file=sys.stderr)
            continue
        sims = [serve(dep, p, requests, compare_limits(name)) for p in [platform, *platform.band()]]
        predicted = [metrics.compute(sim.results(range(len(requests)))[0]) for sim in sims]
        row = {"name": name, **({"elastic": sims[0].controller.report()} if dep.elastic else {})}
        for key in VALIDATED:
            values = [r[key] for r in runs]
            mean = float(np.mean(values))
            band = [min(p[key] for p in predicted), max(p[key] for p in predicted)]
            row[key] = {"predicted": predicted[0][key], "band": band, "in_band": band[0] <= mean <= band[1],
                        "measured": mean, "runs": values,
                        "error": (predicted[0][key] - mean) / mean if mean else None,
                        "spread": (max(values) - min(values)) / mean if mean else None}
        rows.append(row)
        entries.append(at_rate.as_entry(dep, predicted[0], "core"))
    return rows, entries


def compare_slos(compare_dir: Path) -> dict[str, float]:
    """The ``--goodput`` TTFT and TPOT (ms) an elastic server steered by; {} for compare's defaults."""
    doc = json.loads((compare_dir / "compare.json").read_text())
    return {k: float(v) for k, v in ((doc.get("sampling") or {}).get("goodput") or {}).items()
            if k in ELASTIC_SLO_KEYS}


def entry_cores(entry: dict) -> int:
    return len({c for w in entry["resources"]["workers"] for c in w["cores"]})


def wilson_interval(share: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (Wilson, JASA 1927), 95 % at the default ``z``, of a share of
    ``n`` requests; (0, 1) for ``n`` 0."""
    if n <= 0:
        return 0.0, 1.0
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def sweep_attainment(entry: dict, cores: int, platform: Platform, requests: list[workload.Request],
                     slos_ms: dict[str, float], seed: int) -> list[dict]:
    """Per sweep rate: measured attainment with its Wilson interval against the simulated
    one of the same arrivals sent once; unlike a goodput rate, it does not hinge on where a flat
    curve crosses the target. Raises ValueError or NoStepModel."""
    dep = compare_deployment(entry["name"], cores)
    rows = []
    for point in (entry.get("sweep") or {}).get("points", []):
        measured, n = point["slo_attainment"], point["completed"] + point["failed"]
        simulated = measure_rate(dep, platform, requests, slos_ms, point["rate"], compare_limits(entry["name"]),
                                 steady=False, seed=seed)["slo_attainment"]
        lo, hi = wilson_interval(measured, n)
        rows.append({"rate": point["rate"], "measured": measured, "interval": [lo, hi], "simulated": simulated,
                     "error": simulated - measured, "in_interval": lo <= simulated <= hi})
    return sorted(rows, key=lambda r: r["rate"])


def distinct_dirs(dirs: list[str]) -> list[Path]:
    """Raises ValueError for a directory named twice (it would count as its own repeat)."""
    paths = [Path(d) for d in dirs]
    if len({p.resolve() for p in paths}) < len(paths):
        raise ValueError(f"a directory is named twice in {' '.join(dirs)}: repeats must be separate runs")
    return paths


def has_images(compare_dir: Path) -> bool:
    """False without a trace (the fit then names the missing file)."""
    trace = compare_dir / "trace.jsonl"
    return trace.is_file() and any(r.images for r in workload.load_trace(trace))
