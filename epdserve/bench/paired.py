"""Paired evidence: two deployments that served the same trace, compared request by request.

Every deployment of a comparison receives the same requests, so the difference between two
of them is measured on each request (within the SLOs or not, TTFT, longest ITL gap, E2EL),
not between two independent samples: a request that no deployment could serve in time
(a long prompt queued behind another) adds nothing to the difference, and the noise left is
that of the requests on which they disagree.

The difference in goodput per device between A and B gets a confidence interval from a
paired bootstrap over requests and runs (Efron & Tibshirani, *An Introduction to the
Bootstrap*, 1993, ch. 13: the percentile interval; Owen, "The pigeonhole bootstrap", 2007:
runs and requests are crossed, every run serves every request): each of :data:`RESAMPLES` draws picks K run pairs with
replacement out of the K pairs (run k of A with run k of B: the same trace, run side by
side in time) and n request indices with replacement, the same for every run and for A
and B. In a pair, A's goodput per device is (A's requests within the SLOs) / the pair's
mean duration (s) / A's devices, B's the same with B's: both served the same requests
offered over the same time, so the difference is the requests on which they disagree, not
how long each run's last request took (a few seconds of tail that would otherwise decide a
tie); a draw's goodput is the mean over its pairs. The bootstrap is seeded, so the
same results give the same interval.

What the interval says (:func:`decide`), for A the one with the higher goodput:

* ``"tie"``: it lies within ±:data:`TIE_BAND` of the higher goodput: any difference is too
  small to matter (even one that excludes zero: equivalence is judged first, as in a
  two-one-sided test);
* ``"better"``: it excludes zero: A serves more within the SLOs;
* ``"unresolved"``: neither: no difference is shown at this n; more runs may show one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from epdserve.bench import metrics

CONFIDENCE = 0.95
# A goodput difference within ±10 % of the higher goodput is a tie: smaller than what a
# deployment choice is made for, and about what one quiet rerun of the demo moves by.
TIE_BAND = 0.10
RESAMPLES = 4000
SEED = 0
PER_REQUEST = ("good", "ttft_ms", "max_itl_ms", "e2el_ms")  # the arrays compare() pairs
# outcomes()'s value of each SLO key (metrics.SLO_METRICS), what a re-judging reads (rejudge.py).
SLO_VALUES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms", "itl": "max_itl_ms", "itl_p99": "itl_p99_ms"}


def outcomes(result: dict) -> dict:
    """One run's per-request outcomes from a bench result (:func:`metrics.compute`), in
    trace order, judged against the SLOs of :func:`metrics.judged_goodput`:

    ``{"good": [bool] (completed and within every SLO), "ttft_ms", "max_itl_ms" (the
    request's longest ITL gap, 0 without one), "e2el_ms", "tpot_ms" (0 for a one-token
    answer), "itl_p99_ms" (its gaps' p99): [float | None] (None for a failed request),
    "duration_s": the run's duration, "slos_ms"}``: every value an SLO bounds
    (:data:`SLO_VALUES`), so the run can be judged again against other SLOs.

    Raises:
        KeyError: the result has no per-request arrays.
    """
    slos = metrics.judged_goodput(result)["goodput_slos_ms"] or metrics.DEFAULT_SLOS_MS
    out = {k: [] for k in ("good", *SLO_VALUES.values())}
    for ttft, e2el, n, itls, error in zip(result["ttfts"], result["e2els"], result["output_lens"],
                                          result["itls"], result["errors"]):
        values = {} if error else metrics.slo_values_ms(ttft, e2el, n, itls)
        out["good"].append(not error and all(values[k] <= v for k, v in slos.items()))
        for key, name in SLO_VALUES.items():
            out[name].append(values.get(key))
    return {**out, "duration_s": result["duration"], "slos_ms": dict(slos)}


@dataclass(frozen=True)
class Comparison:
    """A against B on the same requests. Goodputs are per device (req/s per core or GPU, or
    requests per USD: whatever ``divisor`` the caller gave), means over the run pairs.

    ``goodput_a``, ``goodput_b``: over each pair's mean duration (module doc); ``delta`` and
    ``ci``: A - B and its interval, in those units; ``relative`` and
    ``relative_ci``: the same ÷ B's goodput (None when B's is 0); ``verdict``: see the
    module doc (from A's side: "better" means A serves more); ``counts``: requests (summed
    over runs) within the SLOs in both, in A only, in B only, in neither; ``ttft_ms``,
    ``max_itl_ms``, ``e2el_ms``: the median per-request difference A - B (ms) over the
    requests both completed, with its interval [lo, hi] (None when none did)."""

    a: str
    b: str
    n: int
    runs: int
    goodput_a: float
    goodput_b: float
    delta: float
    ci: tuple[float, float]
    relative: float | None
    relative_ci: tuple[float, float] | None
    verdict: str
    counts: dict
    ttft_ms: dict | None
    max_itl_ms: dict | None
    e2el_ms: dict | None
    confidence: float = CONFIDENCE
    band: float = TIE_BAND

    def as_json(self) -> dict:
        return asdict(self)


def _interval(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    """The percentile interval of bootstrap draws."""
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    return float(lo), float(hi)


def decide(goodput_a: float, goodput_b: float, ci: tuple[float, float],
           band: float = TIE_BAND) -> str:
    """"tie", "better" (A), "worse" (A serves less) or "unresolved" (module doc) for an
    interval ``ci`` of A - B."""
    lo, hi = ci
    edge = band * max(goodput_a, goodput_b)
    if -edge <= lo and hi <= edge:
        return "tie"
    if lo > 0:
        return "better"
    return "worse" if hi < 0 else "unresolved"


def _matrix(runs: list[dict], key: str) -> np.ndarray:
    """(runs, n) float array of one per-request outcome, NaN for None."""
    return np.array([[np.nan if v is None else float(v) for v in r[key]] for r in runs])


def compare(name_a: str, runs_a: list[dict], divisor_a: float, name_b: str,
            runs_b: list[dict], divisor_b: float, confidence: float = CONFIDENCE,
            band: float = TIE_BAND, resamples: int = RESAMPLES, seed: int = SEED,
            per_request: bool = True) -> Comparison:
    """A against B by the paired two-stage bootstrap of the module doc.

    ``runs_a``, ``runs_b``: :func:`outcomes` of each run, paired in order (the first K of
    each, K the shorter list); ``divisor_a``, ``divisor_b``: what goodput (req/s) is divided
    by (devices, or USD per second; 1 for plain goodput); ``per_request``: also the median
    per-request differences (TTFT, longest gap, E2EL; None without), the costlier part.

    Raises:
        ValueError: no runs, or runs of different traces (different request counts).
    """
    k = min(len(runs_a), len(runs_b))
    if k == 0:
        raise ValueError("paired.compare: no runs to compare")
    runs_a, runs_b = runs_a[:k], runs_b[:k]
    n = len(runs_a[0]["good"])
    if any(len(r["good"]) != n for r in runs_a + runs_b):
        raise ValueError("paired.compare: the runs did not serve the same trace (request counts differ)")
    good_a, good_b = _matrix(runs_a, "good"), _matrix(runs_b, "good")
    # Both runs of a pair are divided by their mean duration: the same requests offered over
    # the same time, so the difference is which requests each served within the SLOs, not
    # how long the last one took.
    durations = np.array([(a["duration_s"] + b["duration_s"]) / 2 for a, b in zip(runs_a, runs_b)])
    per_s = np.divide(1.0, durations, out=np.zeros_like(durations), where=durations > 0)
    scale_a, scale_b = per_s / divisor_a, per_s / divisor_b
    g_a = float((good_a.sum(axis=1) * scale_a).mean())
    g_b = float((good_b.sum(axis=1) * scale_b).mean())
    differences = {key: _matrix(runs_a, key) - _matrix(runs_b, key)
                   for key in (PER_REQUEST[1:] if per_request else ())}
    drawn = {key: [] for key in PER_REQUEST}
    for rows, reqs in _draws(np.random.default_rng(seed), k, n, resamples):
        drawn["good"].append(_goodput(good_a, scale_a, rows, reqs) - _goodput(good_b, scale_b, rows, reqs))
        for key, diff in differences.items():
            drawn[key].append(_medians(diff[rows[:, :, None], reqs[:, None, :]]))
    ci = _interval(np.concatenate(drawn["good"]), confidence)
    delta = g_a - g_b
    in_a, in_b = good_a.astype(bool), good_b.astype(bool)
    counts = {"both": int((in_a & in_b).sum()), "a_only": int((in_a & ~in_b).sum()),
              "b_only": int((~in_a & in_b).sum()), "neither": int((~in_a & ~in_b).sum())}
    diffs = {key: None if key not in differences or np.all(np.isnan(differences[key])) else
             {"median": float(np.nanmedian(differences[key])),
              "ci": list(_interval(np.concatenate(drawn[key]), confidence))}
             for key in PER_REQUEST[1:]}
    return Comparison(
        a=name_a, b=name_b, n=n, runs=k, goodput_a=g_a, goodput_b=g_b, delta=delta, ci=ci,
        relative=delta / g_b if g_b > 0 else None,
        relative_ci=(ci[0] / g_b, ci[1] / g_b) if g_b > 0 else None,
        verdict=decide(g_a, g_b, ci, band), counts=counts, confidence=confidence, band=band,
        **diffs)


def _draws(rng: np.random.Generator, k: int, n: int, resamples: int):
    """The bootstrap's draws in chunks of at most ~1M cells: (runs (r, k), requests (r, n))
    index arrays, r draws per chunk, ``resamples`` in all. A draw's request indices are the
    same in each of its runs (the module doc)."""
    per_chunk = max(1, min(resamples, 1_000_000 // (k * n)))
    for start in range(0, resamples, per_chunk):
        r = min(per_chunk, resamples - start)
        yield rng.integers(0, k, size=(r, k)), rng.integers(0, n, size=(r, n))


def _goodput(matrix: np.ndarray, scale: np.ndarray, rows: np.ndarray, reqs: np.ndarray) -> np.ndarray:
    """Per draw: the mean over its runs of (requests within the SLOs) × the run's scale."""
    return (matrix[rows[:, :, None], reqs[:, None, :]].sum(axis=2) * scale[rows]).mean(axis=1)


def _medians(drawn: np.ndarray) -> np.ndarray:
    """Per draw (r, k, n): the median of its non-NaN values (0 for a draw with none)."""
    flat = drawn.reshape(len(drawn), -1)
    empty = np.isnan(flat).all(axis=1)
    flat[empty] = 0.0
    return np.nanmedian(flat, axis=1)


def percent(v: float | None) -> str:
    """"+12 %", "-3.4 %" (None: "—")."""
    if v is None:
        return "—"
    p = v * 100
    return f"{p:+.0f} %" if abs(p) >= 10 else f"{p:+.1f} %"


def describe(c: Comparison, unit: str) -> str:
    """The comparison in one clause: "colocated is better: goodput req/s per core +35 %
    (95 % CI +12..+60 %; 0.116 vs 0.086)" (A's side) and the per-request counts."""
    what = f"goodput {unit}"
    if c.relative_ci is not None:
        size = (f"{percent(c.relative)} ({c.confidence:.0%} CI {percent(c.relative_ci[0])}.."
                f"{percent(c.relative_ci[1])}; {c.goodput_a:.3g} vs {c.goodput_b:.3g})")
    else:
        size = f"{c.goodput_a:.3g} vs {c.goodput_b:.3g} ({c.confidence:.0%} CI of the difference {c.ci[0]:.3g}..{c.ci[1]:.3g})"
    per_request = (f"per request, within the SLOs in both {c.counts['both']}, only {c.a} "
                   f"{c.counts['a_only']}, only {c.b} {c.counts['b_only']}, neither {c.counts['neither']}")
    if c.verdict == "better":
        head = f"{c.a} is better: {what} {size}"
    elif c.verdict == "worse":
        head = f"{c.b} is better: {c.a}'s {what} is {size}"
    elif c.verdict == "tie":
        head = f"a tie within ±{c.band:.0%}: {what} {c.a} vs {c.b} {size}"
    else:
        head = f"no difference shown at n = {c.n} requests × {c.runs} run{'s' if c.runs > 1 else ''}: {what} {c.a} vs {c.b} {size}"
    return f"{head}; {per_request}"


def goodput(runs: list[dict], divisor: float = 1.0) -> float:
    """The mean over ``runs`` (:func:`outcomes`) of (requests within the SLOs) / duration (s)
    / ``divisor``: the goodput :func:`compare` compares."""
    rates = [sum(r["good"]) / r["duration_s"] / divisor if r["duration_s"] > 0 else 0.0 for r in runs]
    return float(np.mean(rates)) if rates else 0.0
