"""Two deployments that served the same trace, compared request by request: a 95 % percentile
interval of the goodput difference from a paired two-stage bootstrap over runs and requests
(Efron & Tibshirani 1993, ch. 13; runs and requests crossed as in Owen's pigeonhole bootstrap,
2007), seeded. Verdicts for A, the higher: "tie" (within ±:data:`TIE_BAND` of it, judged first
as in a two-one-sided test), "better" (excludes zero), "unresolved" (neither)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from epdserve.bench import metrics

CONFIDENCE = 0.95
# Within ±10 % is a tie: less than a deployment choice is made for, about one quiet rerun's drift.
TIE_BAND = 0.10
RESAMPLES = 4000
SEED = 0
PER_REQUEST = ("good", "ttft_ms", "max_itl_ms", "e2el_ms")
# outcomes()'s key of each SLO (metrics.SLO_METRICS), what rejudge.py reads.
SLO_VALUES = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms", "itl": "max_itl_ms", "itl_p99": "itl_p99_ms"}


def outcomes(result: dict) -> dict:
    """One run's per-request outcomes against :func:`metrics.judged_goodput`'s SLOs: ``good``
    and every value an SLO bounds (:data:`SLO_VALUES`, ms, None for a failed request), so the run
    can be judged again; plus ``duration_s`` and ``slos_ms``. Raises KeyError without arrays."""
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
    """A against B. Goodputs are per ``divisor`` (device or USD), means over run pairs;
    ``delta``/``ci`` are A - B, ``relative``/``relative_ci`` the same ÷ B's (None when B's is 0);
    ``counts`` of requests within the SLOs in both, A only, B only, neither; ``ttft_ms``,
    ``max_itl_ms``, ``e2el_ms``: median per-request A - B (ms) with its interval, or None."""

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
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    return float(lo), float(hi)


def decide(goodput_a: float, goodput_b: float, ci: tuple[float, float],
           band: float = TIE_BAND) -> str:
    """"tie", "better", "worse" or "unresolved" for A's side of an interval of A - B."""
    lo, hi = ci
    edge = band * max(goodput_a, goodput_b)
    if -edge <= lo and hi <= edge:
        return "tie"
    if lo > 0:
        return "better"
    return "worse" if hi < 0 else "unresolved"


def _matrix(runs: list[dict], key: str) -> np.ndarray:
    """(runs, n) floats, NaN for None."""
    return np.array([[np.nan if v is None else float(v) for v in r[key]] for r in runs])


def compare(name_a: str, runs_a: list[dict], divisor_a: float, name_b: str,
            runs_b: list[dict], divisor_b: float, confidence: float = CONFIDENCE,
            band: float = TIE_BAND, resamples: int = RESAMPLES, seed: int = SEED,
            per_request: bool = True) -> Comparison:
    """``runs_a``/``runs_b`` are paired in order (the first K of each); goodput is divided by
    ``divisor_*`` (devices, USD per second, or 1); ``per_request`` adds the costlier median
    per-request differences.

    Raises ValueError: no runs, or runs of different traces."""
    k = min(len(runs_a), len(runs_b))
    if k == 0:
        raise ValueError("paired.compare: no runs to compare")
    runs_a, runs_b = runs_a[:k], runs_b[:k]
    n = len(runs_a[0]["good"])
    if any(len(r["good"]) != n for r in runs_a + runs_b):
        raise ValueError("paired.compare: the runs did not serve the same trace (request counts differ)")
    good_a, good_b = _matrix(runs_a, "good"), _matrix(runs_b, "good")
        # Both runs of a pair over their mean duration: the same requests offered over the same
        # time, so the difference is which requests each served, not how long the last took.
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
    """(run indices (r, k), request indices (r, n)) in chunks of ~1M cells; a draw's request
    indices are the same in each of its runs."""
    per_chunk = max(1, min(resamples, 1_000_000 // (k * n)))
    for start in range(0, resamples, per_chunk):
        r = min(per_chunk, resamples - start)
        yield rng.integers(0, k, size=(r, k)), rng.integers(0, n, size=(r, n))


def _goodput(matrix: np.ndarray, scale: np.ndarray, rows: np.ndarray, reqs: np.ndarray) -> np.ndarray:
    return (matrix[rows[:, :, None], reqs[:, None, :]].sum(axis=2) * scale[rows]).mean(axis=1)


def _medians(drawn: np.ndarray) -> np.ndarray:
    """Per draw (r, k, n): the median of non-NaN values, 0 for none."""
    flat = drawn.reshape(len(drawn), -1)
    empty = np.isnan(flat).all(axis=1)
    flat[empty] = 0.0
    return np.nanmedian(flat, axis=1)


def percent(v: float | None) -> str:
    if v is None:
        return "—"
    p = v * 100
    return f"{p:+.0f} %" if abs(p) >= 10 else f"{p:+.1f} %"


def describe(c: Comparison, unit: str) -> str:
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
    """Mean over runs of (requests within the SLOs) / duration (s) / ``divisor``."""
    rates = [sum(r["good"]) / r["duration_s"] / divisor if r["duration_s"] > 0 else 0.0 for r in runs]
    return float(np.mean(rates)) if rates else 0.0
