"""Benchmark metrics from the client's per-request records, defined here as vLLM's
``bench serve`` computes them.

Per request, with t0 = just before the HTTP request was sent:

* TTFT = first text-carrying chunk − t0;
* ITL = every gap between consecutive text-carrying chunks, pooled over requests
  (a chunk that carries several tokens is one gap, as in vLLM ``bench serve``);
* TPOT = (E2EL − TTFT) / (output_tokens − 1), only for output_tokens > 1;
* E2EL = last chunk − t0.

Run-wide: ``duration`` is first send → last completion (s); throughputs divide by it;
goodput counts completed requests meeting every SLO given (ms; see :data:`SLO_METRICS`; a
one-token request has TPOT 0 for this test, as in vLLM).

SLOs: ``ttft``, ``tpot`` and ``e2el`` are the ones of vLLM ``bench serve --goodput`` and of
DistServe (Zhong et al., OSDI 2024, which judges by TTFT and TPOT). TPOT is a per-request
*mean*, so a stream that froze for 2 s among fast tokens still meets it: it hides the
stutter that a long prefill causes in colocated decodes, exactly what splitting prefill
from decode removes. Hence two per-request inter-token SLOs: ``itl`` (the request's
longest gap between text-carrying chunks) and ``itl_p99`` (its p99 gap, ``numpy.percentile``
linear); a request with one chunk or none has no gap and meets both.
:data:`DEFAULT_SLOS_MS` are the SLOs a comparison is judged by when none are given.

The result dict uses vLLM ``bench serve`` field names: aggregates in milliseconds
(``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p90/p95/p99_ttft_ms`` and the same
for tpot, itl, e2el, or the metrics and percentiles asked for, as ``bench serve
--percentile-metrics`` and ``--metric-percentiles`` choose them: ``p99.9_ttft_ms`` for 99.9;
percentiles by ``numpy.percentile``, linear; std with ddof 0), and, as vLLM does, raw
per-request arrays in trace order with times in **seconds**: ``ttfts``, ``itls`` (a list per
request), ``latencies`` (E2EL; ``e2els`` holds the same, the name this project used first),
``input_lens``, ``output_lens``,
``generated_texts``, ``errors``, ``start_times`` (actual send time after the run's start,
s; vLLM's are absolute ``perf_counter`` times, equal up to a constant), plus
``request_ids``, ``start_offsets`` (the same as ``start_times``, the name this project
used first) and ``kinds``. ``max_output_tokens_per_s`` and ``max_concurrent_requests`` are
vLLM's peaks over 1-second buckets (:func:`peaks_per_second`). ``error_counts`` counts
failed requests by kind of error (:func:`error_kind`); ``slo_attainment`` is the share of
all requests meeting every SLO.
A failed request has ``ttft``/``e2el`` 0 and output length 0 there, as in vLLM;
an empty set of values gives 0.0 aggregates, also as in vLLM.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import numpy as np

from epdserve.bench.client import RequestRecord

PERCENTILES = (90, 95, 99)
# The metrics whose mean, median, std and percentiles a result holds (vLLM's names).
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el", "itl", "itl_p99")
# What each SLO bounds, in the words a report uses.
SLO_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2EL", "itl": "longest ITL gap",
              "itl_p99": "ITL p99 per request"}
STALL_MS = 1000.0  # an ITL gap this long is a stall a user notices; a p99 can hide a few
# The SLOs a comparison is judged by when none are given: loose chat SLOs (a first token
# within 2 s, 5 tokens/s on average, about reading speed) that the default small model
# meets on CPUs at a light load, and no gap over STALL_MS, the stall the mean (TPOT) hides.
DEFAULT_SLOS_MS = {"ttft": 2000.0, "tpot": 200.0, "itl": STALL_MS}


def tpot_s(record: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output_tokens − 1) in seconds; None when output_tokens <= 1."""
    n = record.output_tokens
    if not record.success or n <= 1:
        return None
    return (record.e2el_s - record.ttft_s) / (n - 1)


def percentile_key(p: float, name: str) -> str:
    """``p99_ttft_ms`` for (99, "ttft"), ``p99.9_ttft_ms`` for 99.9: vLLM's ``p{word}``
    (the integer when the percentile is whole)."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{name}_ms"


def summarize(name: str, values_s: list[float], percentiles=PERCENTILES) -> dict:
    """``mean/median/std_{name}_ms`` and one ``p{P}_{name}_ms`` per percentile (0-100)
    of ``values_s`` (seconds in, ms out)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(np.mean(ms)),
           f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        out[percentile_key(p, name)] = float(np.percentile(ms, p))
    return out


def slo_values_ms(ttft_s: float, e2el_s: float, output_tokens: int, itls_s: list[float],
                  keys: Collection[str] = SLO_METRICS) -> dict[str, float]:
    """The value each SLO in ``keys`` (of :data:`SLO_METRICS`) is checked against for one
    completed request (ms): TTFT, TPOT (0 for a one-token request, as vLLM), E2EL, its
    longest ITL gap and its p99 gap (both 0 without a gap). Only the asked keys are
    computed: the planner checks thousands of simulated requests per rate."""
    values = {"ttft": ttft_s * 1000.0, "e2el": e2el_s * 1000.0}
    if "tpot" in keys:
        values["tpot"] = ((e2el_s - ttft_s) / (output_tokens - 1) * 1000.0
                          if output_tokens > 1 else 0.0)
    if "itl" in keys:
        values["itl"] = max(itls_s, default=0.0) * 1000.0
    if "itl_p99" in keys:
        values["itl_p99"] = float(np.percentile(itls_s, 99)) * 1000.0 if itls_s else 0.0
    return values


def check_slos(slos_ms: dict[str, float]) -> None:
    """Raises ValueError naming the keys of ``slos_ms`` not in :data:`SLO_METRICS`."""
    unknown = set(slos_ms) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {SLO_METRICS}")


def slo_goodput(result: dict, slos_ms: dict[str, float]) -> dict:
    """``{"request_goodput": req/s, "slo_attainment": share}`` of a result dict against
    ``slos_ms`` (ms), from its per-request arrays (``ttfts``, ``e2els``, ``output_lens``,
    ``itls``, ``errors``) and ``duration``: requests without an error meeting every SLO,
    per second of the run and as a share of all its requests (failed ones count as misses,
    as DistServe's attainment is over all requests, so a server that drops requests cannot
    look better than one that serves them). Works on results read back from disk.

    Raises:
        ValueError: an SLO key not in :data:`SLO_METRICS`.
        KeyError: the result has no per-request arrays.
    """
    check_slos(slos_ms)
    good = 0
    for ttft, e2el, n, itls, error in zip(result["ttfts"], result["e2els"],
                                          result["output_lens"], result["itls"],
                                          result["errors"]):
        if not error:
            values = slo_values_ms(ttft, e2el, n, itls, slos_ms)
            good += all(values[k] <= v for k, v in slos_ms.items())
    duration, total = result["duration"], len(result["errors"])
    return {"request_goodput": good / duration if duration > 0 else 0.0,
            "slo_attainment": good / total if total else 0.0}


def judged_goodput(result: dict) -> dict:
    """The goodput a comparison judges a result by: ``{"request_goodput", "slo_attainment",
    "goodput_slos_ms", "goodput_slos_default"}`` — as measured when the run had SLOs,
    else against :data:`DEFAULT_SLOS_MS` from the per-request arrays
    (``goodput_slos_default`` True). All None for a result with neither (e.g. a combined
    result, see :mod:`epdserve.bench.repeats`, whose runs had no SLOs: it stores these)."""
    if result.get("request_goodput") is not None:
        return {"request_goodput": result["request_goodput"],
                "slo_attainment": result.get("slo_attainment"),
                "goodput_slos_ms": result.get("goodput_slos_ms"),
                "goodput_slos_default": bool(result.get("goodput_slos_default"))}
    if "ttfts" not in result:
        return dict.fromkeys(("request_goodput", "slo_attainment", "goodput_slos_ms",
                              "goodput_slos_default"))
    return {**slo_goodput(result, DEFAULT_SLOS_MS), "goodput_slos_ms": dict(DEFAULT_SLOS_MS),
            "goodput_slos_default": True}


def describe_slos(slos_ms: dict[str, float]) -> str:
    """``"TTFT ≤ 2000 ms, TPOT ≤ 200 ms, longest ITL gap ≤ 1000 ms"`` for ``slos_ms``."""
    return ", ".join(f"{SLO_LABELS.get(k, k)} ≤ {v:g} ms" for k, v in slos_ms.items())


# Names for httpx exceptions an operator recognises; other exceptions keep their class name.
_EXCEPTION_KINDS = {"ConnectError": "connection refused", "ReadError": "connection reset",
                    "RemoteProtocolError": "connection reset", "WriteError": "connection reset",
                    "ReadTimeout": "timeout", "WriteTimeout": "timeout",
                    "ConnectTimeout": "timeout", "PoolTimeout": "timeout"}


def error_kind(error: str) -> str:
    """A short class of a client error message (see :mod:`epdserve.bench.client`):
    "HTTP 400", "error event", "connection reset", "timeout", "stream ended before
    [DONE]", ...; the part before the first ": " otherwise."""
    head = error.split(": ", 1)[0]
    return _EXCEPTION_KINDS.get(head, head)


def peaks_per_second(ok: list[RequestRecord]) -> tuple[float, int]:
    """(most text chunks received in one second, most completed requests active in one
    second), over 1-second buckets from the first send — vLLM ``bench serve``'s
    ``max_output_tokens_per_s`` and ``max_concurrent_requests`` (a chunk counts as one
    token there too; a request is active in every bucket from its send to its last chunk).
    (0.0, 0) without completed requests."""
    if not ok:
        return 0.0, 0
    first = min(r.start_s for r in ok)
    buckets = int(np.ceil(max(r.start_s + r.e2el_s for r in ok) - first)) + 1
    chunks = np.zeros(buckets)
    active = np.zeros(buckets, dtype=int)
    for r in ok:
        for t in r.chunk_times_s:
            chunks[int(r.start_s + t - first)] += 1
        active[int(r.start_s - first):int(r.start_s + r.e2el_s - first) + 1] += 1
    return float(chunks.max()), int(active.max())


def compute(records: list[RequestRecord], slos_ms: dict[str, float] | None = None,
            percentiles=PERCENTILES, selected=PERCENTILE_METRICS) -> dict:
    """The result dict (see the module doc) for ``records``, in trace order.

    ``selected``: the metrics of :data:`PERCENTILE_METRICS` whose aggregates it holds;
    ``percentiles``: which percentiles (0-100) of them.

    ``slos_ms``: optional SLOs, keys among :data:`SLO_METRICS`, values in ms; when given,
    ``request_goodput`` = completed requests meeting all of them / duration (req/s) and
    ``slo_attainment`` = those requests / all requests of the run (failed ones miss),
    both by :func:`slo_goodput`, and ``goodput_slos_ms`` = ``slos_ms``; else both are None
    (:func:`judged_goodput` judges such a result by :data:`DEFAULT_SLOS_MS` later, from
    the per-request arrays kept here).

    Raises:
        ValueError: an SLO key not in :data:`SLO_METRICS`.
    """
    ok = [r for r in records if r.success]
    if records:
        duration = max(r.end_s for r in records) - min(r.start_s for r in records)
    else:
        duration = 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "request_goodput": None,
        "slo_attainment": None,
    }
    result["max_output_tokens_per_s"], result["max_concurrent_requests"] = peaks_per_second(ok)
    values = {"ttft": lambda: [r.ttft_s for r in ok],
              "tpot": lambda: [t for t in map(tpot_s, ok) if t is not None],
              "itl": lambda: [g for r in ok for g in r.itls_s],
              "e2el": lambda: [r.e2el_s for r in ok]}
    for name in PERCENTILE_METRICS:
        if name in selected:
            result.update(summarize(name, values[name](), percentiles))
    result.update(_per_request(records))
    if slos_ms:
        result.update(slo_goodput(result, slos_ms), goodput_slos_ms=dict(slos_ms))
    return result


def _per_request(records: list[RequestRecord]) -> dict:
    """The per-request arrays of the result dict (see the module doc), in trace order."""
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in records],
        "itls": [r.itls_s if r.success else [] for r in records],
        "latencies": [r.e2el_s if r.success else 0.0 for r in records],
        "e2els": [r.e2el_s if r.success else 0.0 for r in records],
        "generated_texts": [r.generated_text for r in records],
        # "" for a completed request: slo_goodput and the plots read success from here.
        "errors": [r.error or ("" if r.success else "failed") for r in records],
        "error_counts": dict(Counter(error_kind(r.error) for r in records
                                     if not r.success).most_common()),
        "request_ids": [r.request_id for r in records],
        "start_times": [r.start_s for r in records],
        "start_offsets": [r.start_s for r in records],
        "kinds": [r.kind for r in records],
    }
