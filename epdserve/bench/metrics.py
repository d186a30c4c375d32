"""Benchmark metrics from the client's records, computed as vLLM ``bench serve`` computes them
(field names included); definitions in docs/architecture.md, "Client metrics"."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

import numpy as np

from epdserve.bench.client import RequestRecord

PERCENTILES = (90, 95, 99)
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el", "itl", "itl_p99")
SLO_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2EL", "itl": "longest ITL gap",
              "itl_p99": "ITL p99 per request"}
STALL_MS = 1000.0  # an ITL gap a user notices; a p99 can hide a few
# Loose chat SLOs the default small model meets on CPUs at a light load.
DEFAULT_SLOS_MS = {"ttft": 2000.0, "tpot": 200.0, "itl": STALL_MS}


def tpot_s(record: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output_tokens − 1) in seconds; None when output_tokens <= 1."""
    n = record.output_tokens
    if not record.success or n <= 1:
        return None
    return (record.e2el_s - record.ttft_s) / (n - 1)


def percentile_key(p: float, name: str) -> str:
    """``p99_ttft_ms`` for (99, "ttft"), ``p99.9_ttft_ms`` for 99.9, as vLLM names them."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{name}_ms"


def summarize(name: str, values_s: list[float], percentiles=PERCENTILES) -> dict:
    """Mean, median, std (ddof 0) and percentiles (0-100) of ``values_s``: seconds in, ms out."""
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
    """Per-SLO values (ms) of one completed request; TPOT and gaps are 0 where undefined.
    Only ``keys`` are computed: the planner checks thousands of simulated requests per rate."""
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
    """Raises ValueError naming the keys not in :data:`SLO_METRICS`."""
    unknown = set(slos_ms) - set(SLO_METRICS)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {SLO_METRICS}")


def slo_goodput(result: dict, slos_ms: dict[str, float]) -> dict:
    """``request_goodput`` (req/s) and ``slo_attainment`` (share of all requests, failed ones
    missing, as DistServe) of a result's per-request arrays against ``slos_ms`` (ms).

    Raises ValueError for an unknown SLO key, KeyError for a result without per-request arrays."""
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
    """Goodput as measured when the run had SLOs, else against :data:`DEFAULT_SLOS_MS`
    (``goodput_slos_default`` True); all None for a result without per-request arrays."""
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
    return ", ".join(f"{SLO_LABELS.get(k, k)} ≤ {v:g} ms" for k, v in slos_ms.items())


_EXCEPTION_KINDS = {"ConnectError": "connection refused", "ReadError": "connection reset",
                    "RemoteProtocolError": "connection reset", "WriteError": "connection reset",
                    "ReadTimeout": "timeout", "WriteTimeout": "timeout",
                    "ConnectTimeout": "timeout", "PoolTimeout": "timeout"}


def error_kind(error: str) -> str:
    """"HTTP 400", "connection reset", "timeout", ...: the text before the first ": ",
    with httpx exception names mapped."""
    head = error.split(": ", 1)[0]
    return _EXCEPTION_KINDS.get(head, head)


def peaks_per_second(ok: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: peaks over
    1-second buckets from the first send (a chunk counts as one token)."""
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
    """The result dict of ``records``, in trace order; goodput fields None without ``slos_ms``.

    Raises ValueError for an SLO key not in :data:`SLO_METRICS`."""
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
