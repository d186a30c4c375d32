"""Which configuration to use, and why in numbers: a pure function of the compare entries.

Input: the entries of ``compare.json`` (:func:`epdserve.bench.compare.run_config`: ``name``,
``mode`` ("colocated", "pd" or "epd"), ``result`` (bench result, ms fields), ``per_core``,
``resources``, ``itl_stalls``, ``breakdown``, ``server``), or ``{"name", "error"}`` for a
configuration that did not run. The rules, in order:

1. Candidates are the configurations that ran and completed at least one request; if some
   of them failed no request, only those count (dropping requests is never the better
   setup).
2. With SLOs (the results carry ``request_goodput``): the highest goodput per core wins
   (requests/s meeting every SLO divided by the CPU cores used: the configuration that
   serves the most within the SLOs for the hardware, as DistServe ranks systems by goodput
   per GPU); goodputs within :data:`TIE` count as equal and go to rule 3. When no
   candidate has goodput > 0 the report says that nothing meets the SLOs and rule 3
   picks among all.
3. Otherwise: among the candidates whose TTFT p95 is within :data:`TTFT_TOLERANCE` of the
   best TTFT p95, the lowest ITL p95 (the stalls users feel while streaming); ITL p95s
   within :data:`TIE` of the lowest are a tie, broken by the higher output tokens/s per
   core.

A split (PD) is worth it when the winner is a PD or EPD configuration (both split prefill
from decode); the reasons compare it with the best configuration of the other kind chosen
by the same rules.
"""

from __future__ import annotations

TTFT_TOLERANCE = 0.25  # TTFT p95 up to 25 % above the best still counts as "as fast"
TIE = 0.05  # values within 5 % of each other are a tie
SPLIT_MODES = ("pd", "epd")  # modes with prefill and decode on separate workers


def _r(e: dict, key: str) -> float:
    v = e["result"].get(key)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def _cores(e: dict) -> int | None:
    return (e.get("resources") or {}).get("num_cores")


def _per_core(e: dict, key: str) -> float | None:
    """``per_core[key]``, else the raw result value when the cores are unknown."""
    v = (e.get("per_core") or {}).get(key)
    return v if v is not None else e["result"].get(key)


def _by_latency(cands: list[dict]) -> dict:
    """Rule 3 on a non-empty list."""
    best_ttft = min(_r(e, "p95_ttft_ms") for e in cands)
    fast = [e for e in cands if _r(e, "p95_ttft_ms") <= best_ttft * (1 + TTFT_TOLERANCE)]
    best_itl = min(_r(e, "p95_itl_ms") for e in fast)
    tied = [e for e in fast if _r(e, "p95_itl_ms") <= best_itl * (1 + TIE)]
    return max(tied, key=lambda e: _per_core(e, "output_throughput") or 0.0)


def choose(cands: list[dict], use_goodput: bool) -> dict:
    """The winner of a non-empty candidate list by rule 2 (``use_goodput``) or 3."""
    if use_goodput:
        best = max(_per_core(e, "request_goodput") or 0.0 for e in cands)
        if best > 0:
            cands = [e for e in cands if (_per_core(e, "request_goodput") or 0.0) >= best * (1 - TIE)]
    return _by_latency(cands)


def _ms(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _largest(parts: dict | None, total_label: str) -> str | None:
    """'prefill is 71% of TTFT (mean 1,112 of 1,569 ms)' for a breakdown part summary."""
    if not parts:
        return None
    total = sum(parts["mean"].values())
    if total <= 0:
        return None
    part = max(parts["parts"], key=lambda p: parts["mean"][p])
    share = parts["mean"][part] / total
    return (f"{part} is {share:.0%} of {total_label} (mean {_ms(parts['mean'][part])} of "
            f"{_ms(total)} ms)")


def _cores_text(a: dict, b: dict) -> str:
    ca, cb = _cores(a), _cores(b)
    if ca and ca == cb:
        return f"at the same cores ({ca})"
    return f"with {ca or '?'} vs {cb or '?'} cores"


def _why(win: dict, rival: dict, use_goodput: bool) -> str:
    """The rule that decided between two configurations, in numbers."""
    g_win, g_rival = _per_core(win, "request_goodput") or 0.0, _per_core(rival, "request_goodput") or 0.0
    if use_goodput and g_win > g_rival * (1 + TIE):
        return (f"{win['name']} serves {g_win:.3f} req/s per core within the SLOs, "
                f"{rival['name']} {g_rival:.3f}")
    t_win, t_rival = _r(win, "p95_ttft_ms"), _r(rival, "p95_ttft_ms")
    if t_rival > min(t_win, t_rival) * (1 + TTFT_TOLERANCE):
        return (f"{rival['name']}'s TTFT p95 is {t_rival / t_win - 1:.0%} higher "
                f"(more than {TTFT_TOLERANCE:.0%})")
    i_win, i_rival = _r(win, "p95_itl_ms"), _r(rival, "p95_itl_ms")
    if i_rival > i_win * (1 + TIE):
        return f"{win['name']} has the lower ITL p95 ({1 - i_win / i_rival:.0%} lower)"
    return (f"ITL p95 within {TIE:.0%}, {win['name']} makes more output tok/s per core "
            f"({_per_core(win, 'output_throughput') or 0:.2f} vs "
            f"{_per_core(rival, 'output_throughput') or 0:.2f})")


def recommend(entries: list[dict]) -> dict:
    """Apply the module's rules to compare entries.

    Returns ``{"choice": name | None, "split": bool | None, "rule": str, "meets_slos":
    bool | None (None without SLOs), "reasons": [str, ...], "not_considered": {name:
    why}}``; ``choice`` is None when no configuration completed a request. Never raises
    on missing optional fields (breakdown, cores, server trace).
    """
    cands, not_considered = _candidates(entries)
    use_goodput = any(e["result"].get("request_goodput") is not None for e in cands)
    rule = ("highest goodput per core (req/s within the SLOs / cores), then lowest ITL p95"
            if use_goodput else
            f"lowest ITL p95 among those with TTFT p95 within {TTFT_TOLERANCE:.0%} of the "
            f"best, ties ({TIE:.0%}) to output tok/s per core")
    out = {"choice": None, "split": None, "rule": rule, "meets_slos": None, "reasons": [],
           "not_considered": not_considered}
    if not cands:
        out["reasons"].append("No configuration completed a request; nothing to recommend.")
        return out
    win = choose(cands, use_goodput)
    out["choice"], out["split"] = win["name"], win.get("mode") in SPLIT_MODES
    reasons = out["reasons"]
    if use_goodput:
        out["meets_slos"] = any((e["result"].get("request_goodput") or 0) > 0 for e in cands)
        if not out["meets_slos"]:
            reasons.append("No configuration meets the SLOs at this load (goodput 0 in all); "
                           "the choice below is by latency. Lower the rate, add cores or "
                           "relax the SLOs.")
    reasons.append(_verdict(win, cands, out["split"], use_goodput))
    reasons += _where_time_goes(cands)
    reasons += _overview(cands, use_goodput, not_considered)
    return out


def _candidates(entries: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Rule 1: the entries that compete, and why each other one does not."""
    not_considered = {e["name"]: e["error"] for e in entries if "error" in e}
    ran = [e for e in entries if "result" in e]
    for e in ran:
        if not e["result"].get("completed"):
            not_considered[e["name"]] = "no request completed"
    cands = [e for e in ran if e["result"].get("completed")]
    clean = [e for e in cands if not e["result"].get("failed")]
    for e in cands:
        if clean and e not in clean:
            not_considered[e["name"]] = f"{e['result']['failed']} failed requests"
    return clean or cands, not_considered


def _verdict(win: dict, cands: list[dict], split: bool, use_goodput: bool) -> str:
    """The winner against the best of the other kind (split vs not), in numbers."""
    others = [e for e in cands if (e.get("mode") in SPLIT_MODES) != split]
    if not others:
        return f"Use {win['name']} (the only kind measured: {'PD' if split else 'colocated'})."
    rival = choose(others, use_goodput)
    verdict = (f"{win['name']} vs {rival['name']} {_cores_text(win, rival)}: "
               f"{_why(win, rival, use_goodput)}; ITL p50 {_ms(_r(win, 'median_itl_ms'))} "
               f"vs {_ms(_r(rival, 'median_itl_ms'))} ms, ITL p95 "
               f"{_ms(_r(win, 'p95_itl_ms'))} vs {_ms(_r(rival, 'p95_itl_ms'))} ms, TTFT "
               f"p95 {_ms(_r(win, 'p95_ttft_ms'))} vs {_ms(_r(rival, 'p95_ttft_ms'))} ms")
    return f"Split prefill and decode: {verdict}." if split else f"Do not split at this load: {verdict}."


def _where_time_goes(cands: list[dict]) -> list[str]:
    """Each candidate's largest TTFT stage, and its PD hand-off gap when it has one."""
    reasons = []
    for e in cands:
        b = e.get("breakdown") or {}
        t = _largest(b.get("ttft"), "TTFT")
        if t:
            reasons.append(f"Bottleneck of {e['name']}: {t}.")
        if b.get("handoff"):
            reasons.append(_handoff_reason(e, b))
    return reasons


def _handoff_reason(e: dict, b: dict) -> str:
    """The hand-off gap (token 1 -> 2) of one configuration against its TTFT and ITL."""
    h = b["handoff"]
    gap = sum(h["mean"].values())
    ttft = sum((b.get("ttft") or {}).get("mean", {}).values()) or _r(e, "mean_ttft_ms")
    itl = _r(e, "median_itl_ms")
    kv = (e.get("server") or {}).get("mean_kv_bytes")
    return (f"Hand-off of {e['name']} (token 1 -> 2): mean {_ms(gap)} ms = "
            f"{gap / ttft:.0%} of its mean TTFT and {gap / itl:.1f}x its ITL p50"
            + (f", {kv / 1e6:.1f} MB of KV per request" if kv else "")
            + f"; {_largest(h, 'the gap')}"
            + ("; other is the decode worker's first step, batched with the running "
               "requests, plus IPC hops." if max(h["mean"], key=h["mean"].get) == "other"
               else "."))


def _overview(cands: list[dict], use_goodput: bool, not_considered: dict[str, str]) -> list[str]:
    """Every candidate's ITL tail, goodput and resources side by side; who was left out."""
    reasons = ["ITL p95 / p99 and stalls (gaps > 1 s): " + "; ".join(
        f"{e['name']} {_ms(_r(e, 'p95_itl_ms'))} / {_ms(_r(e, 'p99_itl_ms'))} ms, "
        f"{e.get('itl_stalls', 0)} stalls" for e in cands) + "."]
    if use_goodput:
        reasons.append("Goodput per core: " + "; ".join(
            f"{e['name']} {_per_core(e, 'request_goodput') or 0:.3f} req/s" for e in cands) + ".")
    reasons.append("Resources: " + "; ".join(
        f"{e['name']} {_cores(e) or '?'} cores, "
        f"{_per_core(e, 'output_throughput') or 0:.2f} output tok/s per core" for e in cands)
        + ".")
    reasons += [f"Not considered: {name} ({why})." for name, why in not_considered.items()]
    return reasons
