"""The serving slowdown: how much slower served steps are than the engine's alone.

Served steps are slower than the engine alone: the router and the bench client share the
cores with the workers and every step's outputs are encoded, routed, detokenized and
streamed. ``epdserve plan calibrate --from-compare DIR...`` learns that from ``compare``
runs (:func:`compare_runs`: the client's token times and the server's trace,
:class:`~epdserve.trace.RequestTrace` records, as one :class:`ServedRun` per configuration).

* Decode: :func:`decode_gaps` rebuilds every decode-only step of every worker and sets the
  measured gap beside the step model's time for that batch; :func:`fit_serving` takes the
  ratio of their 95th percentiles (steps with a core free) as ``serving.decode_slowdown``,
  and how much slower steps were while every other core was busy as
  ``serving.contended_slowdown``; :func:`step_uncertainty` says how far the runs agree.
* Prefill: :func:`prefill_steps` takes every served prefill that no other prefill shared
  a step with and sets its ``prefill_ms`` beside the step model's time for its new and
  cached tokens (and the decodes batched with it); :func:`fit_prefill` gives, per worker
  size, the median ratio as ``serving.prefill_slowdown``. 1-core workers need it most:
  the router and the client take their time from the same two cores.
"""

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


def prefill_steps(seqs: list[dict], step: Callable[[str], StepModel]) -> list[tuple[str, float, float, float]]:
    """``(worker, measured ms, step-model ms of its prefill, step-model ms of the decodes
    batched with it)`` of every served prefill that no other prefill shared a step with.

    ``seqs``: as :class:`ServedRun` has them (``prefill``: ``(worker, start s, end s, new
    tokens, cached tokens)`` or None: left out). A prefill counts unless another prefill on
    the same worker overlaps it (they were batched, or it waited in a step of the other's);
    the measured time is its ``prefill_ms`` (first scheduled to first token: one step, as
    the engine does not chunk prompts by default). The decodes batched with it are the
    requests that worker decoded with a token before the prefill's middle and another after
    it, each with its prompt + the tokens before the middle − 1 cached, as in
    :func:`decode_gaps`; the step model's split is ``step_ms(prefill, decodes) −
    step_ms([], decodes)`` for the prefill (all of it without decodes) and the rest for the
    decodes.
    """
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
    """``serving.prefill_slowdown``: per worker size (cores), how many times longer a
    served prefill takes than the step model says (dimensionless), from each run's
    :func:`prefill_steps` and its workers' sizes: per step, (measured − ``decode_slowdown``
    × its decodes' model ms) / its prefill's model ms; the median per run and size, then
    the median over the runs of each size (a size no run has is left out: 1, as
    calibrated)."""
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


@dataclass
class ServedRun:
    """One configuration of a ``compare`` output, as the fits read it.

    ``seqs``: one dict per served request as :func:`decode_gaps` takes them, with
    ``prefill``: ``(worker, start s, end s, new tokens, cached tokens)`` of its prefill,
    or None when its record does not say how many tokens were cached (traces of
    epdserve before ``cached_tokens``); ``sizes``: each worker's cores; ``contended(worker,
    t)``: whether every other core was busy at ``t`` s."""

    seqs: list[dict]
    sizes: dict[str, int]
    contended: Callable[[str, float], bool]

    def step(self, platform: Platform) -> Callable[[str], StepModel]:
        """Each worker's step model: ``platform``'s for that worker's cores."""
        return lambda worker: platform.step(self.sizes[worker])


def compare_runs(compare_dir: str | Path, platform: Platform) -> dict[str, ServedRun]:
    """Each configuration of an ``epdserve compare`` output (its ``compare.json``,
    ``trace.jsonl`` and ``NAME.server.jsonl``) that ran, by name, elastic and
    tensor-parallel ones left out (:func:`fitted_on`); requests without a server record,
    failed or with fewer than two tokens are left out.

    Raises:
        ValueError: ``compare_dir`` lacks those files, or its results merge several rounds
            (``--repeats``), which keep no per-request times.
    """
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
    """Whether the serving slowdowns are fitted on a configuration of a compare run (its
    compare.json ``entry``): not on an elastic one (its workers change role: no fixed
    placement to fit steps to) nor on one with tensor-parallel workers of any role (their
    times are not those of the one-process fits these slowdowns are of: an engine worker's
    steps are the TP fit's, ``tp_steps``)."""
    if entry.get("mode") == "elastic":
        return False
    try:
        spec = DeploymentSpec.parse(entry["name"])
    except ValueError:
        return True  # a name of another epdserve: its workers' cores say what they are
    return all(spec.role_tp(role) == 1 for role in ("colocated", "encode", "prefill", "decode"))


def compare_gaps(compare_dir: str | Path, platform: Platform) -> dict[str, list[tuple[float, float, bool]]]:
    """:func:`decode_gaps` of each configuration of an ``epdserve compare`` output
    (:func:`compare_runs`), with the step models of ``platform`` for each worker's cores.

    Raises:
        ValueError: ``compare_dir`` lacks its files.
    """
    return {name: decode_gaps(run.seqs, run.step(platform), run.contended)
            for name, run in compare_runs(compare_dir, platform).items()}


def _served_run(entry: dict, requests: list[workload.Request], records: list[RequestTrace],
                platform: Platform) -> ServedRun:
    """One configuration of a ``compare`` output: ``entry`` (its ``compare.json`` entry:
    the client's result and each worker's cores), the requests of the trace it served and
    its server trace ``records``."""
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
