"""Benchmark metrics from the client's per-request records, defined here as vLLM's
``bench serve`` computes them.

Per request, with t0 = just before the HTTP request was sent:

* TTFT = first text-carrying chunk − t0;
* ITL = every gap between consecutive text-carrying chunks, pooled over requests
  (a chunk that carries several tokens is one gap, as in vLLM ``bench serve``);
* TPOT = (E2EL − TTFT) / (output_tokens − 1), only for output_tokens > 1;
* E2EL = last chunk − t0.

Run-wide: ``duration`` is first send → last completion (s); throughputs divide by it;
goodput counts completed requests meeting every SLO given (TTFT, TPOT, E2EL, in ms; a
one-token request has TPOT 0 for this test, as in vLLM).

The result dict uses vLLM ``bench serve`` field names: aggregates in milliseconds
(``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p90/p95/p99_ttft_ms`` and the same
for tpot, itl, e2el; percentiles by ``numpy.percentile``, linear; std with ddof 0), and, as
vLLM does, raw per-request arrays in trace order with times in **seconds**: ``ttfts``,
``itls`` (a list per request), ``e2els``, ``input_lens``, ``output_lens``,
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

import numpy as np

from epdserve.bench.client import RequestRecord

PERCENTILES = (90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


def tpot_s(record: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output_tokens − 1) in seconds; None when output_tokens <= 1."""
    n = record.output_tokens
    if not record.success or n <= 1:
        return None
    return (record.e2el_s - record.ttft_s) / (n - 1)


def summarize(name: str, values_s: list[float]) -> dict:
    """``mean/median/std/p90/p95/p99_{name}_ms`` of ``values_s`` (seconds in, ms out)."""
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(np.mean(ms)),
           f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when a completed request is within every SLO (ms) in ``slos_ms``."""
    if not record.success:
        return False
    values_ms = {"ttft": record.ttft_s * 1000.0, "e2el": record.e2el_s * 1000.0,
                 "tpot": (tpot_s(record) or 0.0) * 1000.0}
    return all(values_ms[k] <= v for k, v in slos_ms.items())


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


def compute(records: list[RequestRecord], slos_ms: dict[str, float] | None = None) -> dict:
    """The result dict (see the module doc) for ``records``, in trace order.

    ``slos_ms``: optional SLOs, keys among ttft, tpot, e2el, values in ms; when given,
    ``request_goodput`` = completed requests meeting all of them / duration (req/s) and
    ``slo_attainment`` = those requests / all requests of the run (failed ones miss),
    else both are None.
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
    }
    if slos_ms:
        unknown = set(slos_ms) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {SLO_METRICS}")
        good = sum(meets_slos(r, slos_ms) for r in ok)
        result["request_goodput"] = per_s(good)
        # Failed requests count as misses (DistServe's attainment is over all requests),
        # so a server that drops requests cannot look better than one that serves them.
        result["slo_attainment"] = good / len(records) if records else 0.0
        result["goodput_slos_ms"] = dict(slos_ms)
    else:
        result["request_goodput"] = None
        result["slo_attainment"] = None
    result["max_output_tokens_per_s"], result["max_concurrent_requests"] = peaks_per_second(ok)
    result.update(summarize("ttft", [r.ttft_s for r in ok]))
    result.update(summarize("tpot", [t for t in map(tpot_s, ok) if t is not None]))
    result.update(summarize("itl", [g for r in ok for g in r.itls_s]))
    result.update(summarize("e2el", [r.e2el_s for r in ok]))
    result.update({
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in records],
        "itls": [r.itls_s if r.success else [] for r in records],
        "e2els": [r.e2el_s if r.success else 0.0 for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "error_counts": dict(Counter(error_kind(r.error) for r in records
                                     if not r.success).most_common()),
        "request_ids": [r.request_id for r in records],
        "start_times": [r.start_s for r in records],
        "start_offsets": [r.start_s for r in records],
        "kinds": [r.kind for r in records],
    })
    return result
