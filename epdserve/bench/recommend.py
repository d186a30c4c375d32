"""The words of the recommendation: :mod:`epdserve.bench.rules` applied to compare's entries,
with the headline, the paired verdict against the rival, where the time goes and the evidence."""

from __future__ import annotations

import math

from epdserve.bench import metrics, paired, rules


def _ms(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _num(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "—"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _span(e: dict, basis: str) -> str:
    r = rules.goodput_range(e, basis)
    return _num(rules.score(e, basis)) + (f" ({_num(r[0])}–{_num(r[1])})" if r else "")


def _largest(parts: dict | None, total_label: str) -> str | None:
    if not parts:
        return None
    total = sum(parts["mean"].values())
    if total <= 0:
        return None
    part = max(parts["parts"], key=lambda p: parts["mean"][p])
    share = parts["mean"][part] / total
    return (f"{part} is {share:.0%} of {total_label} (mean {_ms(parts['mean'][part])} of "
            f"{_ms(total)} ms)")


def _devices_text(a: dict, b: dict) -> str:
    (ka, na), (kb, nb) = rules.devices(a), rules.devices(b)
    if na and (ka, na) == (kb, nb):
        return f"on the same {ka}s ({na})"
    return f"with {na or '?'} {ka}s vs {nb or '?'} {kb}s"


def _why(win: dict, rival: dict, basis: str, unit: str, c: paired.Comparison | None) -> str:
    """Without a paired comparison ``c``, from the goodputs; under overload, the ranking measure."""
    if rules.overloaded([win, rival]):
        return _why_overload(win, rival)
    g_win, g_rival = rules.score(win, basis), rules.score(rival, basis)
    if max(g_win, g_rival) <= 0:
        return _why_latency(win, rival)
    simpler = (f"; {win['name']} is the simpler (no prefill/decode split, no KV hand-off)"
               if win.get("mode") not in rules.SPLIT_MODES else "")
    if c is not None:
        if c.verdict == "worse":  # picked among those tied with the leader, which rival is not
            return f"{win['name']} ties with the best goodput; {paired.describe(c, rules.goodput_unit(unit))}"
        return paired.describe(c, rules.goodput_unit(unit)) + (simpler if c.verdict != "better" else "")
    spans = (f"{win['name']} {_span(win, basis)}, {rival['name']} {_span(rival, basis)} "
             f"{rules.goodput_unit(unit)}")
    if rules.cannot_tell_apart(win, rival, basis):
        how = ("ranges overlap" if rules.goodput_range(win, basis) and rules.goodput_range(rival, basis)
               else f"within {rules.TIE:.0%}, one run each")
        return f"cannot tell apart by goodput ({how}: {spans}){simpler}"
    if g_win > g_rival:
        return (f"{win['name']} serves {_span(win, basis)} {rules.goodput_unit(unit)} within the SLOs, "
                f"{rival['name']} {_span(rival, basis)}")
    return f"{win['name']} ties with the best goodput, {rival['name']} does not ({spans})"


def _why_overload(win: dict, rival: dict) -> str:
    if rules.overload_measure([win, rival]) == "capacity":
        return (f"by capacity (the highest rate within the SLOs, per device): {win['name']} "
                f"{rules.capacity(win):.3g}, {rival['name']} {rules.capacity(rival):.3g} req/s")
    c = rules.comparison(win, rival, per_request=True)
    e2el = (c.e2el_ms if c else None)
    how = (f"median per-request difference {_ms(e2el['median'])} ms ({c.confidence:.0%} CI "
           f"{_ms(e2el['ci'][0])}..{_ms(e2el['ci'][1])} ms)" if e2el else "no per-request interval")
    separated = e2el["ci"][1] < 0 if e2el else rules.e2el_separates(win, rival)
    shown = "shown lower" if separated else "not shown different"
    return (f"by E2EL per request, {win['name']}'s is {shown} than {rival['name']}'s: p50 "
            f"{_ms(rules.value(win, 'median_e2el_ms'))} vs {_ms(rules.value(rival, 'median_e2el_ms'))} ms, {how}")


def _why_latency(win: dict, rival: dict) -> str:
    """Rule 3."""
    t_win, t_rival = rules.value(win, "p95_ttft_ms"), rules.value(rival, "p95_ttft_ms")
    if t_rival > min(t_win, t_rival) * (1 + rules.TTFT_TOLERANCE):
        return (f"{rival['name']}'s TTFT p95 is {t_rival / t_win - 1:.0%} higher "
                f"(more than {rules.TTFT_TOLERANCE:.0%})")
    i_win, i_rival = rules.value(win, "p95_itl_ms"), rules.value(rival, "p95_itl_ms")
    if i_rival > i_win * (1 + rules.TIE):
        return f"{win['name']} has the lower ITL p95 ({1 - i_win / i_rival:.0%} lower)"
    return (f"ITL p95 within {rules.TIE:.0%}, {win['name']} makes more output tok/s per device "
            f"({rules.output_per_device(win):.2f} vs {rules.output_per_device(rival):.2f})")


def recommend(entries: list[dict]) -> dict:
    """``{"choice", "split", "rule", "meets_slos", "overloaded", "elastic_switches", "slos_ms",
    "slos_default", "basis", "n", "runs", "cannot_tell_apart", "verdict", "comparison",
    "headline", "settled", "unsettled", "slos", "evidence", "reasons", "not_considered"}``;
    ``choice`` None when nothing completed a request. Tolerates missing optional fields."""
    cands, not_considered = rules.candidates(entries)
    basis = rules.basis_of(cands) if cands else "device"
    unit = rules.unit_label(cands, basis)
    judged = [rules.figures(e) for e in cands]
    slos = next((f["slos_ms"] for f in judged if f["slos_ms"]), metrics.DEFAULT_SLOS_MS)
    default = next((f["slos_default"] for f in judged if f["slos_ms"]), True)
    out = {"choice": None, "split": None, "meets_slos": None, "overloaded": False,
           "slos_ms": dict(slos), "slos_default": default, "basis": unit, "n": rules.requests_per_run(cands),
           "runs": rules.runs_per_config(cands), "cannot_tell_apart": [], "verdict": None, "comparison": None,
           "headline": "**No recommendation.**", "settled": True, "unsettled": [],
           "rule": _rule(unit), "slos": _slos_line(slos, default, unit), "evidence": "",
           "reasons": [], "not_considered": not_considered}
    if not cands:
        out["reasons"].append("No configuration completed a request; nothing to recommend.")
        return out
    win, tied = rules.choose(cands, basis)
    split = win.get("mode") in rules.SPLIT_MODES
    switches = ((win.get("role_switches") or {}).get("count") or 0) if win.get("mode") == "elastic" else None
    out.update(choice=win["name"], split=split, elastic_switches=switches,
               cannot_tell_apart=[e["name"] for e in tied], overloaded=rules.overloaded(cands),
               meets_slos=any((f["request_goodput"] or 0) > 0 for f in judged),
               evidence=_evidence(cands, basis, unit), **rules.settled(cands, basis))
    reasons = out["reasons"]
    if out["overloaded"]:
        reasons.append(_overload_reason(cands))
    if len({str(f["slos_ms"]) for f in judged}) > 1:
        reasons.append("Warning: the configurations were measured against different SLOs; "
                       "their goodputs do not compare.")
    rival = rules.rival_of(win, cands, basis)
    c = rules.comparison(win, rival, basis, per_request=True) if rival and not out["overloaded"] else None
    out.update(comparison=c.as_json() if c else None, **_headline(win, rival, c, out, unit))
    reasons.append(_verdict(win, rival, split, basis, unit, c))
    if out["verdict"] == "no difference shown":
        reasons.append("To tell them apart: more rounds (--repeats auto with a larger --budget) "
                       "or more requests per run (--num-prompts); until then the simpler is the "
                       "safer choice.")
    reasons += _where_time_goes(cands)
    reasons += _overview(cands, basis, not_considered)
    return out


def _headline(win: dict, rival: dict | None, c: paired.Comparison | None, out: dict,
              unit: str) -> dict:
    switches = out.get("elastic_switches")
    kind = (" (a PD split)." if out["split"] else " (no prefill/decode split).") if switches is None else \
        f" (elastic: {switches} role switch{'' if switches == 1 else 'es'} during the run)."
    name, simpler = win["name"], " (the simpler: no prefill/decode split)."
    differs = ""  # between engines, a verdict that is not "better" says what differs besides goodput
    if rival is not None and rules.engine(rival) != rules.engine(win):  # engines: named as what they are
        kind = simpler = f" ({rules.what(win)})."
        differs = f" What differs: {_latencies(win, rival)}."
    if out["overloaded"]:
        return {"verdict": "overloaded",
                "headline": f"**Overloaded: no configuration serves most requests within the SLOs; "
                            f"by {rules.overload_measure([win, rival] if rival else [win])}, use {name}**{kind}"}
    if rival is None:
        return {"verdict": "only one kind", "headline": f"**Use {name}**{kind}"}
    if c is None or c.verdict == "worse":  # worse: picked among those tied with the leader
        tied = out["cannot_tell_apart"]
        head = (f"**Cannot tell {_names(tied)} apart by goodput; use {name}**"
                + (simpler if not out["split"] else kind)) if tied else f"**Use {name}**{kind}"
        return {"verdict": "no interval" if c is None else "tie", "headline": head + differs}
    if c.verdict == "better":
        return {"verdict": "better", "headline": (
            f"**Use {name}**{kind[:-1]}: goodput {rules.goodput_unit(unit)} {_size(c)} over "
            f"{rival['name']} ({c.confidence:.0%} CI {_ci_text(c)}).")}
    ending = simpler if not out["split"] else kind
    if c.verdict == "tie":
        return {"verdict": "tie", "headline": (
            f"**{name} and {rival['name']} tie by goodput (within ±{c.band:.0%}, {c.confidence:.0%} "
            f"CI {_ci_text(c)}); use {name}**{ending}{differs}")}
    return {"verdict": "no difference shown", "headline": (
        f"**No difference shown between {name} and {rival['name']} at n = {c.n} requests × "
        f"{c.runs} run{'s' if c.runs > 1 else ''} (goodput {_size(c)}, "
        f"{c.confidence:.0%} CI {_ci_text(c)}); use {name}**{ending}{differs}")}


def _size(c: paired.Comparison) -> str:
    """Relative to the rival's goodput, absolute when that is 0."""
    return paired.percent(c.relative) if c.relative is not None else f"{c.delta:+.3g}"


def _ci_text(c: paired.Comparison) -> str:
    """Relative to the rival's goodput, absolute when that is 0."""
    if c.relative_ci is None:
        return f"{c.ci[0]:+.3g}..{c.ci[1]:+.3g}"
    return f"{paired.percent(c.relative_ci[0])}..{paired.percent(c.relative_ci[1])}".replace(" %", "") + " %"


def _names(names: list[str]) -> str:
    return " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def _overload_reason(cands: list[dict]) -> str:
    shares = ", ".join(f"{e['name']} {rules.figures(e)['slo_attainment'] or 0:.0%}" for e in cands)
    measure = rules.overload_measure(cands)
    by = ("capacity from the sweep (the highest rate within the SLOs, per device)"
          if measure == "capacity" else "per-request E2EL, paired (the one that drains the load "
          "sooner), since no sweep was run")
    return (f"Overloaded: every configuration misses the SLOs for most requests ({shares} within "
            f"them), so goodput does not rank them at this load. Ranked by {by}. To decide by "
            f"goodput: send fewer requests per second (--request-rate), measure each "
            f"configuration's capacity (--goodput ... --sweep-rates LO:HI), or add workers.")


def _rule(unit: str) -> str:
    return (f"highest goodput {unit} (requests/s within the SLOs); those whose paired "
            f"{paired.CONFIDENCE:.0%} interval of the difference from the best includes zero "
            f"(a tie within ±{paired.TIE_BAND:.0%}, or no difference shown) go to the simpler "
            f"(colocated), then to the lowest ITL p95 among those with TTFT p95 within "
            f"{rules.TTFT_TOLERANCE:.0%} of the best, ties ({rules.TIE:.0%}) to output tok/s per device; "
            f"when every configuration serves under {rules.MOST:.0%} of its requests within the SLOs "
            f"(overload), capacity from a sweep, else per-request E2EL, replaces goodput")


def _slos_line(slos: dict, default: bool, unit: str) -> str:
    if default:
        return (f"Judged by goodput {unit} against the default SLOs: "
                f"{metrics.describe_slos(slos)}; pass --goodput to set yours.")
    return f"Judged by goodput {unit} against your SLOs (--goodput): {metrics.describe_slos(slos)}."


def _evidence(cands: list[dict], basis: str, unit: str) -> str:
    n, runs = rules.requests_per_run(cands), rules.runs_per_config(cands)
    if not all(e.get("per_run") for e in cands):
        if runs < 2:
            return (f"n = {n} requests, 1 run per configuration, no per-request outcomes: the "
                    f"spread is unknown, so goodputs within {rules.TIE:.0%} count as a tie and "
                    f"larger differences may still be noise.")
        return (f"n = {n} requests per run, {runs} runs per configuration, no per-request "
                f"outcomes; goodput {unit}, median (min–max): "
                + "; ".join(f"{e['name']} {_span(e, basis)}" for e in cands)
                + f" {rules.goodput_unit(unit)}.")
    out = (f"n = {n} requests per run, {runs} run{'s' if runs > 1 else ''} per configuration, "
           f"paired request by request ({paired.CONFIDENCE:.0%} intervals by a paired bootstrap "
           f"over the requests{' and runs' if runs > 1 else ''}).")
    if runs < 2:
        out += (" With one run the interval covers the requests only, not a drift of the machine between "
                "runs: a verdict to act on wants two or more rounds (--repeats 2, or a larger --budget).")
    left = [f"{e['name']} {len(e['flagged_runs'])}" for e in cands if e.get("flagged_runs")]
    if left:
        out += " Runs the load check flagged, left out of the verdict: " + ", ".join(left) + "."
    return out


def _verdict(win: dict, rival: dict | None, split: bool, basis: str, unit: str,
             c: paired.Comparison | None) -> str:
    if rival is None:
        kind = "elastic" if win.get("mode") == "elastic" else "PD" if split else "colocated"
        return f"Use {win['name']} (the only kind measured: {kind})."
    if rules.engine(rival) != rules.engine(win):
        return (f"Engines: {win['name']} ({rules.what(win)}) vs {rival['name']} ({rules.what(rival)}): "
                f"{_why(win, rival, basis, unit, c)}{_per_request_text(c)}; {_latencies(win, rival)}.")
    verdict = (f"{win['name']} vs {rival['name']} {_devices_text(win, rival)}: "
               f"{_why(win, rival, basis, unit, c)}{_per_request_text(c)}; {_latencies(win, rival)}")
    return f"Split prefill and decode: {verdict}." if split else f"Do not split at this load: {verdict}."


def _latencies(win: dict, rival: dict) -> str:
    memory = [e.get("memory_peak_bytes") for e in (win, rival)]
    return (f"ITL p50 {_ms(rules.value(win, 'median_itl_ms'))} vs {_ms(rules.value(rival, 'median_itl_ms'))} ms, "
            f"ITL p95 {_ms(rules.value(win, 'p95_itl_ms'))} vs {_ms(rules.value(rival, 'p95_itl_ms'))} ms, TTFT "
            f"p95 {_ms(rules.value(win, 'p95_ttft_ms'))} vs {_ms(rules.value(rival, 'p95_ttft_ms'))} ms"
            + (f", peak memory {memory[0] / 2**30:.2f} vs {memory[1] / 2**30:.2f} GiB" if all(memory) else ""))


def _per_request_text(c: paired.Comparison | None) -> str:
    if c is None or not c.ttft_ms:
        return ""
    parts = [f"{label} {_ms(d['median'])} ms ({_ms(d['ci'][0])}..{_ms(d['ci'][1])})"
             for label, d in (("TTFT", c.ttft_ms), ("longest ITL gap", c.max_itl_ms)) if d]
    return f"; per request ({c.a} - {c.b}, median, {c.confidence:.0%} CI): " + ", ".join(parts)


def _where_time_goes(cands: list[dict]) -> list[str]:
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
    h = b["handoff"]
    gap = sum(h["mean"].values())
    ttft = sum((b.get("ttft") or {}).get("mean", {}).values()) or rules.value(e, "mean_ttft_ms")
    itl = rules.value(e, "median_itl_ms")
    kv = (e.get("server") or {}).get("mean_kv_bytes")
    return (f"Hand-off of {e['name']} (token 1 -> 2): mean {_ms(gap)} ms = "
            f"{gap / ttft:.0%} of its mean TTFT and {gap / itl:.1f}x its ITL p50"
            + (f", {kv / 1e6:.1f} MB of KV per request (mean)" if kv else "")
            + f"; {_largest(h, 'the gap')}"
            + ("; the first decode step is the decode worker's step that takes in the KV, "
               "batched with the running requests." if max(h["mean"], key=h["mean"].get) == "first decode step"
               else "."))


def _overview(cands: list[dict], basis: str, not_considered: dict[str, str]) -> list[str]:
    reasons = ["ITL p95 / p99 and stalls (gaps > 1 s): " + "; ".join(
        f"{e['name']} {_ms(rules.value(e, 'p95_itl_ms'))} / {_ms(rules.value(e, 'p99_itl_ms'))} ms, "
        f"{e.get('itl_stalls', 0)} stalls" for e in cands) + "."]
    bases = ["device"] + (["usd"] if any(rules.figures(e)["price_per_hour"] for e in cands) else [])
    for b in bases:
        have = [e for e in cands if rules.figures(e)[f"goodput_per_{b}"] is not None] or cands
        lead = max(have, key=lambda e: rules.score(e, b))
        unit = rules.unit_label(cands, b)
        reasons.append(f"Goodput {unit} (share of requests within the SLOs): " + "; ".join(
            f"{e['name']} {_span(e, b)} {rules.goodput_unit(unit)} "
            f"({rules.figures(e)['slo_attainment'] or 0:.0%})" for e in have)
            + f"; {lead['name']} leads {unit}.")
    if basis == "device" and rules.unit_label(cands) == "per device":
        reasons.append("Per device compares CPU cores with GPUs; give each deployment's "
                       "price_per_hour to compare per USD.")
    reasons.append("Resources: " + "; ".join(
        f"{e['name']} {rules.devices(e)[1] or '?'} {rules.devices(e)[0]}s, "
        f"{rules.output_per_device(e):.2f} output tok/s per {rules.devices(e)[0]}" for e in cands) + ".")
    reasons += [f"Not considered: {name} ({why})." for name, why in not_considered.items()]
    return reasons
