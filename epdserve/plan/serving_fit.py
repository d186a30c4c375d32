"""The serving slowdown: how much slower served steps are than the engine alone, fitted on
``compare`` runs' client token times and server traces (``plan calibrate --from-compare``;
method in docs/planner.md, "Serving slowdown")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from epdserve.bench import server_trace, workload
from epdserve.bench.deployments import file_stem
from epdserve.plan.costmodel import Platform, StepModel
from epdserve.plan.simulate import prompt_tokens
from epdserve.serving.deployment import DeploymentSpec
from epdserve.trace import RequestTrace

# The ITL percentile the slowdown is fitted at: the planner's SLOs and validation are p95.
SERVING_PERCENTILE = 95


def decode_gaps(seqs: list[dict], step: Callable[[str], StepModel],
                contended: Callable[[str, float], bool] = lambda worker, t: False) -> list[tuple[float, float, bool]]:
    """``(measured ms, model ms, contended)`` per decode-only step the token times show;
    ``seqs``: ``worker``, ``prompt_tokens``, ``token_times_s`` and ``busy_s`` (its prefill on that
    worker, None when prefilled elsewhere). Gaps overlapping a prefill or spanning a hand-off are
    left out."""
    out = []
    for x in seqs:
        mates = [y for y in seqs if y["worker"] == x["worker"]]
        busy = [y["busy_s"] for y in mates if y["busy_s"] is not None]
        times = x["token_times_s"]
        for k in range(1 if x["busy_s"] is not None else 2, len(times)):
            a, b = times[k - 1], times[k]
            if any(start < b and end > a for start, end in busy):
                continue
            mid = (a + b) / 2
            context = [y["prompt_tokens"] + int(np.searchsorted(y["token_times_s"], mid)) - 1
                       for y in mates if y["token_times_s"][0] <= mid < y["token_times_s"][-1]]
            out.append(((b - a) * 1e3, step(x["worker"]).step_ms([], len(context), sum(context), max(context)),
                        contended(x["worker"], mid)))
    return out


def prefill_steps(seqs: list[dict], step: Callable[[str], StepModel]) -> list[tuple[str, float, float, float]]:
    """``(worker, measured ms, model ms of the prefill, model ms of the decodes batched with
    it)`` per served prefill no other prefill on its worker overlapped; measured is ``prefill_ms``
    (one step: prompts are not chunked by default)."""
    prefills = [x["prefill"] for x in seqs if x["prefill"] is not None]
    out = []
    for i, (worker, start, end, new, cached) in enumerate(prefills):
        if any(w == worker and s < end and e > start for j, (w, s, e, _, _) in enumerate(prefills) if j != i):
            continue
        mid = (start + end) / 2
        context = [y["prompt_tokens"] + int(np.searchsorted(y["token_times_s"], mid)) - 1
                   for y in seqs if y["worker"] == worker and y["token_times_s"][0] <= mid < y["token_times_s"][-1]]
        model = step(worker)
        decodes = model.step_ms([], len(context), sum(context), max(context)) if context else 0.0
        total = model.step_ms([(new, cached)], len(context), sum(context), max(context, default=0))
        out.append((worker, (end - start) * 1e3, total - decodes, decodes))
    return out


def fit_prefill(runs: list[tuple[list[tuple[str, float, float, float]], dict[str, int]]],
                decode_slowdown: float) -> dict[int, float]:
    """Per worker size (cores), the median over runs of each run's median (measured -
    ``decode_slowdown`` × decodes) / prefill model ms; sizes no run has are left out (1)."""
    per_size: dict[int, list[float]] = {}
    for steps, sizes in runs:
        by_size: dict[int, list[float]] = {}
        for worker, measured, prefill, decodes in steps:
            if prefill > 0:
                by_size.setdefault(sizes[worker], []).append((measured - decode_slowdown * decodes) / prefill)
        for size, ratios in by_size.items():
            per_size.setdefault(size, []).append(float(np.median(ratios)))
    return {size: float(np.median(r)) for size, r in sorted(per_size.items())}


def gap_percentiles(gaps: list[tuple[float, float, bool]]) -> tuple[float, float]:
    """p95 (numpy linear) of the measured and model ms of uncontended gaps; nan without any."""
    free = [g for g in gaps if not g[2]]
    if not free:
        return float("nan"), float("nan")
    return tuple(float(np.percentile([g[i] for g in free], SERVING_PERCENTILE)) for i in (0, 1))


def contention_ratio(gaps: list[tuple[float, float, bool]]) -> float | None:
    """Median measured/model of contended over uncontended steps, within one run so what
    moves the whole run cancels; None without both."""
    kinds = [[m / model for m, model, c in gaps if c == contended] for contended in (True, False)]
    return float(np.median(kinds[0]) / np.median(kinds[1])) if all(kinds) else None


def fit_serving(runs: list[list[tuple[float, float, bool]]]) -> tuple[float, float]:
    """``(decode_slowdown, contended_slowdown)``: medians over runs of each run's p95 ratio and
    contention ratio, so no one run's outliers decide (contended 1 without any).

    Raises ValueError when no run has an uncontended decode-only step."""
    ratios = [measured / model for measured, model in map(gap_percentiles, filter(None, runs))
              if not np.isnan(measured)]
    if not ratios:
        raise ValueError("no decode-only steps in these runs to fit the serving slowdown on")
    contention = [c for c in map(contention_ratio, runs) if c is not None]
    return float(np.median(ratios)), float(np.median(contention)) if contention else 1.0


def step_uncertainty(serving: dict) -> float:
    """Half the spread of the per-run ratios over their median (relative); 0 with fewer than
    two runs. Runs on one machine spread 10-20 %, so a prediction is a band."""
    ratios = list(serving.get("ratios", {}).values())
    if len(ratios) < 2:
        return 0.0
    return (max(ratios) - min(ratios)) / 2 / serving["decode_slowdown"]


def compare_configs(compare_dir: Path) -> list[dict]:
    """Raises ValueError: no compare.json, or not one compare writes."""
    try:
        configs = json.loads((compare_dir / "compare.json").read_text())["configs"]
        if not all(isinstance(c["name"], str) and c["resources"]["workers"] for c in configs):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{compare_dir}: not an `epdserve compare` output (its compare.json is missing "
                         f"or of another kind)") from None
    return configs


@dataclass
class ServedRun:
    """``seqs`` as :func:`decode_gaps` takes them, plus ``prefill``: (worker, start s, end s,
    new, cached tokens), None in traces without ``cached_tokens``; ``sizes``: cores per worker."""

    seqs: list[dict]
    sizes: dict[str, int]
    contended: Callable[[str, float], bool]

    def step(self, platform: Platform) -> Callable[[str], StepModel]:
        return lambda worker: platform.step(self.sizes[worker])


def compare_runs(compare_dir: str | Path, platform: Platform) -> dict[str, ServedRun]:
    """Configurations that ran, by name, except :func:`fitted_on`'s exclusions; requests
    without a record, failed, or of one token are left out.

    Raises ValueError: missing files, or results merging several rounds (no per-request times)."""
    compare_dir = Path(compare_dir)
    configs = compare_configs(compare_dir)
    merged = [e["name"] for e in configs if "result" in e and "request_ids" not in e["result"]]
    if merged:
        raise ValueError(f"{compare_dir}: the results of {', '.join(merged)} merge several rounds (--repeats) and "
                         "keep no per-request times; fit on `epdserve compare --repeats 1` outputs (one directory a run)")
    try:
        requests = workload.load_trace(compare_dir / "trace.jsonl")
    except (FileNotFoundError, workload.TraceError) as exc:
        raise ValueError(f"{compare_dir}: not an `epdserve compare` output ({exc})") from None
    runs = {}
    for entry in configs:
        server = compare_dir / f"{file_stem(entry['name'])}.server.jsonl"
        if "result" in entry and server.is_file() and fitted_on(entry):
            runs[entry["name"]] = _served_run(entry, requests, server_trace.read(server)[0], platform)
    return runs


def fitted_on(entry: dict) -> bool:
    """Not elastic (no fixed placement) and no tensor-parallel workers (their steps are the TP
    fit's, not the one-process fits these slowdowns scale)."""
    if entry.get("mode") == "elastic":
        return False
    try:
        spec = DeploymentSpec.parse(entry["name"])
    except ValueError:
        return True  # a name of another epdserve: its workers' cores say what they are
    return all(spec.role_tp(role) == 1 for role in ("colocated", "encode", "prefill", "decode"))


def compare_gaps(compare_dir: str | Path, platform: Platform) -> dict[str, list[tuple[float, float, bool]]]:
    """Raises ValueError as :func:`compare_runs`."""
    return {name: decode_gaps(run.seqs, run.step(platform), run.contended)
            for name, run in compare_runs(compare_dir, platform).items()}


def _served_run(entry: dict, requests: list[workload.Request], records: list[RequestTrace],
                platform: Platform) -> ServedRun:
    m = entry["result"]
    cores = {w["worker_id"]: tuple(w["cores"]) for w in entry["resources"]["workers"]}
    by_id = {r.request_id: r for r in records}
    seqs, busy = [], {core: [] for cs in cores.values() for core in cs}
    for i, req in enumerate(requests):
        r = by_id.get(m["request_ids"][i])
        if r is None or r.error or not m["itls"][i]:
            continue
        first = m["start_times"][i] + m["ttfts"][i]
        times = (first + np.concatenate([[0.0], np.cumsum(m["itls"][i])])).tolist()
        colocated = r.decode_worker is None
        for worker, start, end in _busy_s(r, first, times[-1]):
            for core in cores.get(worker, ()):
                busy[core].append((start, end))
        prompt = prompt_tokens(platform, req)
        prefill_start = first - r.prefill_ms / 1e3
        seqs.append({"worker": r.worker if colocated else r.decode_worker,
                     "prompt_tokens": prompt, "token_times_s": times,
                     "busy_s": (prefill_start - (r.encode_ms or 0.0) / 1e3, first) if colocated else None,
                     "prefill": None if r.cached_tokens is None else
                     (r.worker if colocated else r.prefill_worker, prefill_start, first,
                      r.prompt_tokens - r.cached_tokens, r.cached_tokens)})

    def contended(worker: str, t: float) -> bool:
        others = set(busy) - set(cores[worker])
        return bool(others) and all(any(a <= t < b for a, b in busy[core]) for core in others)

    return ServedRun(seqs, {w: len(cs) for w, cs in cores.items()}, contended)


def _busy_s(record: RequestTrace, first: float, last: float) -> list[tuple[str, float, float]]:
    """``(worker, start s, end s)`` per worker that worked on the request: encode and prefill end
    at the first token (encode workers' at the prefill queue), decode spans first to last token."""
    encode, prefill = (record.encode_ms or 0.0) / 1e3, record.prefill_ms / 1e3
    if record.decode_worker is None:
        return [(record.worker, first - prefill - encode, last)]
    out = [(record.prefill_worker, first - prefill - (0.0 if record.encode_workers else encode), first),
           (record.decode_worker, first, last)]
    queued = first - prefill - (record.prefill_queue_ms or 0.0) / 1e3
    out += [(w, queued - encode, queued) for w in record.encode_workers or []]
    return out
