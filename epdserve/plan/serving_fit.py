"""The serving slowdown: how much slower served decode steps are than the engine's alone.

Served steps are slower than the engine alone: the router and the bench client share the
cores with the workers and every step's outputs are encoded, routed, detokenized and
streamed. ``epdserve plan calibrate --from-compare DIR...`` learns that from ``compare``
runs: :func:`compare_gaps` rebuilds, from the client's token times and the server's trace
(:class:`~epdserve.trace.RequestTrace` records), every decode-only step of every worker
(:func:`decode_gaps`) and sets the measured gap beside the step model's time for that
batch; :func:`fit_serving` takes the ratio of their 95th percentiles (steps with a core
free) as ``serving.decode_slowdown``, and how much slower steps were while every other core
was busy as ``serving.contended_slowdown``; :func:`step_uncertainty` says how far the runs
agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from epdserve.bench import server_trace, workload
from epdserve.plan.costmodel import Platform, StepModel
from epdserve.plan.simulate import prompt_tokens
from epdserve.trace import RequestTrace

# The percentile of inter-token latency that the serving slowdown is fitted at: the
# planner's SLOs and its validation are p95.
SERVING_PERCENTILE = 95


def decode_gaps(seqs: list[dict], step: Callable[[str], StepModel],
                contended: Callable[[str, float], bool] = lambda worker, t: False) -> list[tuple[float, float, bool]]:
    """``(measured ms, step-model ms, contended)`` of every decode-only step that a served
    run's token times show.

    ``seqs``: one dict per request: ``worker`` (the id of the worker that decoded it),
    ``prompt_tokens`` (its prompt as the engine saw it), ``token_times_s`` (when each of its
    output tokens reached the client, s, ascending) and ``busy_s``: ``(start, end)`` in s
    while its worker prefilled (and encoded) it, or None when another worker did (PD, EPD).
    ``step(worker)``: that worker's step model. Each gap between a request's consecutive
    tokens is one step of its worker. It counts unless some request's ``busy_s`` on the same
    worker overlaps it (a prefill was in the step), or it is the first gap of a request
    prefilled elsewhere (it spans the KV hand-off). The step's decodes are the requests of
    that worker with a token before the middle of the gap and another after it, each with
    its prompt + the tokens before the middle − 1 cached (the last one is this step's input).
    ``contended(worker, t)``: whether every other core was busy at ``t`` s (at the middle).
    """
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


def gap_percentiles(gaps: list[tuple[float, float, bool]]) -> tuple[float, float]:
    """The :data:`SERVING_PERCENTILE` th percentile (``numpy.percentile``, linear, as the
    bench's metrics) of the measured and of the step model's ms of the uncontended
    :func:`decode_gaps` (nan, nan without any)."""
    free = [g for g in gaps if not g[2]]
    if not free:
        return float("nan"), float("nan")
    return tuple(float(np.percentile([g[i] for g in free], SERVING_PERCENTILE)) for i in (0, 1))


def contention_ratio(gaps: list[tuple[float, float, bool]]) -> float | None:
    """How many times slower a run's contended decode steps were than its uncontended ones,
    each measured against the step model: the ratio of the medians of measured / model ms
    (within one run, so what moves the whole run cancels). None without both kinds."""
    kinds = [[m / model for m, model, c in gaps if c == contended] for contended in (True, False)]
    return float(np.median(kinds[0]) / np.median(kinds[1])) if all(kinds) else None


def fit_serving(runs: list[list[tuple[float, float, bool]]]) -> tuple[float, float]:
    """``(decode_slowdown, contended_slowdown)`` (dimensionless) of served runs, each given
    as its :func:`decode_gaps`: per run, the ratio of the :func:`gap_percentiles` (steps
    with a core free) and the :func:`contention_ratio`; then the median of each over the
    runs that have it, so that no one run's outliers decide (contended 1 without any).

    Raises:
        ValueError: no run has an uncontended decode-only step.
    """
    ratios = [measured / model for measured, model in map(gap_percentiles, filter(None, runs))
              if not np.isnan(measured)]
    if not ratios:
        raise ValueError("no decode-only steps in these runs to fit the serving slowdown on")
    contention = [c for c in map(contention_ratio, runs) if c is not None]
    return float(np.median(ratios)), float(np.median(contention)) if contention else 1.0


def step_uncertainty(serving: dict) -> float:
    """How far served step times are known (relative, dimensionless): half the spread
    (max − min) of the per-run ratios that :func:`fit_serving` took the median of, over that
    median; 0 with fewer than two runs (``serving``: a calibration's ``serving`` section).
    Runs of one machine spread by 10–20% (busy cores, other tenants), so a prediction is a
    band, not a point."""
    ratios = list(serving.get("ratios", {}).values())
    if len(ratios) < 2:
        return 0.0
    return (max(ratios) - min(ratios)) / 2 / serving["decode_slowdown"]


def compare_configs(compare_dir: Path) -> list[dict]:
    """The ``configs`` of an ``epdserve compare`` output's ``compare.json``: one dict per
    configuration with its ``name``, ``resources`` and, if it ran, ``result``.

    Raises:
        ValueError: no such file, or not one that ``compare`` writes.
    """
    try:
        configs = json.loads((compare_dir / "compare.json").read_text())["configs"]
        if not all(isinstance(c["name"], str) and c["resources"]["workers"] for c in configs):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{compare_dir}: not an `epdserve compare` output (its compare.json is missing "
                         f"or of another kind)") from None
    return configs


def compare_gaps(compare_dir: str | Path, platform: Platform) -> dict[str, list[tuple[float, float, bool]]]:
    """:func:`decode_gaps` of each configuration of an ``epdserve compare`` output (its
    ``compare.json``, ``trace.jsonl`` and ``NAME.server.jsonl``), with the step models of
    ``platform`` for the cores each worker had; requests without a server record, failed
    or with fewer than two tokens are left out.

    Raises:
        ValueError: ``compare_dir`` lacks those files.
    """
    compare_dir = Path(compare_dir)
    configs = compare_configs(compare_dir)
    try:
        requests = workload.load_trace(compare_dir / "trace.jsonl")
    except (FileNotFoundError, workload.TraceError) as exc:
        raise ValueError(f"{compare_dir}: not an `epdserve compare` output ({exc})") from None
    runs = {}
    for entry in configs:
        server = compare_dir / f"{entry['name']}.server.jsonl"
        if "result" in entry and server.is_file():
            runs[entry["name"]] = _run_gaps(entry, requests, server_trace.read(server)[0], platform)
    return runs


def _run_gaps(entry: dict, requests: list[workload.Request], records: list[RequestTrace],
              platform: Platform) -> list[tuple[float, float, bool]]:
    """:func:`decode_gaps` of one configuration of a ``compare`` output: ``entry`` (its
    ``compare.json`` entry: the client's result and each worker's cores), the requests of
    the trace it served and its server trace ``records``."""
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
        seqs.append({"worker": r.worker if colocated else r.decode_worker,
                     "prompt_tokens": prompt_tokens(platform, req), "token_times_s": times,
                     "busy_s": (first - (r.prefill_ms + (r.encode_ms or 0.0)) / 1e3, first)
                     if colocated else None})

    def contended(worker: str, t: float) -> bool:
        others = set(busy) - set(cores[worker])
        return bool(others) and all(any(a <= t < b for a, b in busy[core]) for core in others)

    return decode_gaps(seqs, lambda worker: platform.step(len(cores[worker])), contended)


def _busy_s(record: RequestTrace, first: float, last: float) -> list[tuple[str, float, float]]:
    """``(worker, start s, end s)`` while the workers of one served request worked on it,
    from its server trace record and its first and last token times: encoding and prefill
    end where its first token came (the encode workers' end where its prefill queue
    began), decoding spans the first to the last token."""
    encode, prefill = (record.encode_ms or 0.0) / 1e3, record.prefill_ms / 1e3
    if record.decode_worker is None:
        return [(record.worker, first - prefill - encode, last)]
    out = [(record.prefill_worker, first - prefill - (0.0 if record.encode_workers else encode), first),
           (record.decode_worker, first, last)]
    queued = first - prefill - (record.prefill_queue_ms or 0.0) / 1e3
    out += [(w, queued - encode, queued) for w in record.encode_workers or []]
    return out
