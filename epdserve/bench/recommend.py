"""Which configuration to use, and why in numbers: a pure function of the compare entries.

Input: the entries of ``compare.json`` (:func:`epdserve.bench.compare.run_config`, or
:func:`epdserve.bench.repeats.combine` over repeated runs: ``name``, ``mode`` ("colocated",
"pd" or "epd"), ``result`` (bench result, ms fields), ``resources`` (``num_cores``, and from
a deployments file ``device_kind`` "core" | "GPU", ``num_devices``, ``price_per_hour`` in
USD), ``itl_stalls``, ``breakdown``, ``server``, with repeats ``runs`` and ``spread``), or
``{"name", "error"}`` for a configuration that did not run.

One rule, always, judged by goodput (requests/s meeting every SLO): against the SLOs given
with ``--goodput``, else against :data:`epdserve.bench.metrics.DEFAULT_SLOS_MS`, and the
recommendation says which. In order:

1. Candidates are the configurations that ran and completed at least one request; if some
   of them failed no request (and no run), only those count (dropping requests is never
   the better setup).
2. The highest goodput per device (per CPU core or per GPU: the configuration that serves
   the most within the SLOs for the hardware, as DistServe ranks systems by goodput per
   GPU) wins; when every candidate has a price, goodput per USD decides instead (a core
   and a GPU are not the same device; a dollar is), and the per-device leader is stated.
   Candidates that cannot be told apart from the leader (with repeats: their [min, max]
   ranges over the runs overlap; with one run: within :data:`TIE`) are a tie: the
   recommendation says "cannot tell apart" and does not pick by noise: among them the
   simpler, colocated (one kind of worker, no KV hand-off), is preferred, then rule 3.
   When no candidate has goodput > 0 the recommendation says that nothing meets the SLOs
   and rule 3 picks among all.
3. Latency: among the candidates whose TTFT p95 is within :data:`TTFT_TOLERANCE` of the
   best TTFT p95, the lowest ITL p95 (the stalls users feel while streaming); ITL p95s
   within :data:`TIE` of the lowest are a tie, broken by the higher output tokens/s per
   device.

A split (PD) is worth it when the winner is a PD or EPD configuration (both split prefill
from decode); the reasons compare it with the best configuration of the other kind chosen
by the same rules. Next to the verdict: the SLOs, n (requests per run), the number of runs
and the spread of goodput (unknown with one run).

:func:`figures` is the one place per-device and per-dollar figures are computed; the
report's table reads them from there.
"""

from __future__ import annotations

import math

from epdserve.bench import metrics

TTFT_TOLERANCE = 0.25  # TTFT p95 up to 25 % above the best still counts as "as fast"
TIE = 0.05  # values within 5 % of each other are a tie (the noise of one run, unmeasured)
# Modes with prefill and decode on separate workers (elastic: at times); never "the simpler".
SPLIT_MODES = ("pd", "epd", "elastic")
S_PER_HOUR = 3600.0


def _r(e: dict, key: str) -> float:
    v = e["result"].get(key)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def devices(entry: dict) -> tuple[str, int | None]:
    """(device kind "core" or "GPU", how many) of an entry's ``resources``: its
    ``device_kind`` and ``num_devices`` (a deployments file), else ``num_cores`` (the
    cores ``/health`` listed); the count is None when unknown."""
    res = entry.get("resources") or {}
    kind = res.get("device_kind") or "core"
    n = res.get("num_devices") or (res.get("num_cores") if kind == "core" else None)
    return kind, n


def figures(entry: dict) -> dict:
    """The figures an entry is judged by, per device and per dollar:

    ``{"device": "core" | "GPU", "num_devices", "price_per_hour" (USD/h or None),
    "slos_ms", "slos_default" (judged against the default SLOs), "request_goodput" (req/s),
    "slo_attainment" (share), "output_throughput" (tok/s), "goodput_per_device" (req/s per
    device), "output_per_device" (tok/s per device), "goodput_per_usd" (requests per USD),
    "output_per_usd" (output tokens per USD), "spread": {key: [min, max]}}``; a figure is
    None when its input is unknown (no device count, no price); ``spread`` holds a key only
    for an entry with repeats (``entry["spread"]``, see :mod:`epdserve.bench.repeats`).
    """
    judged = metrics.judged_goodput(entry["result"])
    kind, n = devices(entry)
    price = (entry.get("resources") or {}).get("price_per_hour")
    spread = entry.get("spread") or {}
    base = {"request_goodput": judged["request_goodput"],
            "slo_attainment": judged["slo_attainment"],
            "output_throughput": entry["result"].get("output_throughput")}
    divisors = {"device": n or None, "usd": price / S_PER_HOUR if price else None}
    out = {"device": kind, "num_devices": n, "price_per_hour": price,
           "slos_ms": judged["goodput_slos_ms"], "slos_default": judged["goodput_slos_default"],
           **base, "spread": {k: spread[k] for k in base if k in spread}}
    for unit, div in divisors.items():
        for name, src in ((f"goodput_per_{unit}", "request_goodput"),
                          (f"output_per_{unit}", "output_throughput")):
            out[name] = base[src] / div if div and base[src] is not None else None
            if div and src in spread:
                out["spread"][name] = [v / div for v in spread[src]]
    return out


def _basis(cands: list[dict]) -> str:
    """"usd" when every candidate has a price, else "device" (rule 2)."""
    return "usd" if all(figures(e)["price_per_hour"] for e in cands) else "device"


def unit_label(entries: list[dict], basis: str = "device") -> str:
    """"per core", "per GPU", "per device" (cores and GPUs mixed) or "per USD"."""
    if basis == "usd":
        return "per USD"
    kinds = {devices(e)[0] for e in entries}
    return f"per {kinds.pop()}" if len(kinds) == 1 else "per device"


def goodput_unit(unit: str) -> str:
    """The unit of goodput for a :func:`unit_label`: "req/s per core", "requests per USD"."""
    return "requests per USD" if unit == "per USD" else f"req/s {unit}"


def _score(e: dict, basis: str) -> float:
    """Goodput per device or per USD; the raw goodput when the divisor is unknown."""
    f = figures(e)
    v = f[f"goodput_per_{basis}"]
    return v if v is not None else (f["request_goodput"] or 0.0)


def _range(e: dict, basis: str) -> list[float] | None:
    f = figures(e)
    key = f"goodput_per_{basis}" if f[f"goodput_per_{basis}"] is not None else "request_goodput"
    return f["spread"].get(key)


def cannot_tell_apart(a: dict, b: dict, basis: str = "device") -> bool:
    """True when the goodputs of ``a`` and ``b`` (per device or per USD) differ by no more
    than the noise: their [min, max] ranges over the runs overlap, or, when either has
    one run only, they are within :data:`TIE` of each other."""
    ra, rb = _range(a, basis), _range(b, basis)
    if ra and rb:
        return ra[0] <= rb[1] and rb[0] <= ra[1]
    sa, sb = _score(a, basis), _score(b, basis)
    return min(sa, sb) >= max(sa, sb) * (1 - TIE)


def _output_per_device(e: dict) -> float:
    f = figures(e)
    return f["output_per_device"] or f["output_throughput"] or 0.0


def _by_latency(cands: list[dict]) -> dict:
    """Rule 3 on a non-empty list."""
    best_ttft = min(_r(e, "p95_ttft_ms") for e in cands)
    fast = [e for e in cands if _r(e, "p95_ttft_ms") <= best_ttft * (1 + TTFT_TOLERANCE)]
    best_itl = min(_r(e, "p95_itl_ms") for e in fast)
    tied = [e for e in fast if _r(e, "p95_itl_ms") <= best_itl * (1 + TIE)]
    return max(tied, key=_output_per_device)


def choose(cands: list[dict], basis: str = "device") -> tuple[dict, list[dict]]:
    """(winner, the candidates that cannot be told apart from the goodput leader, [] when
    the leader stands alone or nothing meets the SLOs) of a non-empty candidate list by
    rule 2, then 3."""
    leader = max(cands, key=lambda e: _score(e, basis))
    if _score(leader, basis) <= 0:
        return _by_latency(cands), []
    tied = [e for e in cands if e is leader or cannot_tell_apart(e, leader, basis)]
    simple = [e for e in tied if e.get("mode") not in SPLIT_MODES]
    return _by_latency(simple or tied), tied if len(tied) > 1 else []


def _ms(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def _num(v: float | None) -> str:
    """A goodput or throughput figure with 3 significant digits ("—" when unknown)."""
    if v is None or math.isnan(v):
        return "—"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _span(e: dict, basis: str) -> str:
    """"0.12" or, with repeats, "0.12 (0.1–0.14)": goodput per device or per USD."""
    r = _range(e, basis)
    return _num(_score(e, basis)) + (f" ({_num(r[0])}–{_num(r[1])})" if r else "")


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


def _devices_text(a: dict, b: dict) -> str:
    (ka, na), (kb, nb) = devices(a), devices(b)
    if na and (ka, na) == (kb, nb):
        return f"on the same {ka}s ({na})"
    return f"with {na or '?'} {ka}s vs {nb or '?'} {kb}s"


def _why(win: dict, rival: dict, basis: str, unit: str) -> str:
    """What decided between two configurations, in numbers: goodput, else latency."""
    g_win, g_rival = _score(win, basis), _score(rival, basis)
    if max(g_win, g_rival) <= 0:
        return _why_latency(win, rival)  # nothing meets the SLOs: rule 3 chose both
    spans = (f"{win['name']} {_span(win, basis)}, {rival['name']} {_span(rival, basis)} "
             f"{goodput_unit(unit)}")
    if cannot_tell_apart(win, rival, basis):
        how = ("ranges overlap" if _range(win, basis) and _range(rival, basis)
               else f"within {TIE:.0%}, one run each")
        simpler = (f"; {win['name']} is the simpler (no prefill/decode split, no KV hand-off)"
                   if win.get("mode") not in SPLIT_MODES else "")
        return f"cannot tell apart by goodput ({how}: {spans}){simpler}"
    if g_win > g_rival:
        return (f"{win['name']} serves {_span(win, basis)} {goodput_unit(unit)} within the SLOs, "
                f"{rival['name']} {_span(rival, basis)}")
    # The winner was picked among those that cannot be told apart from the leader, which
    # the rival is not part of: say so rather than a rule that did not decide.
    return f"{win['name']} ties with the best goodput, {rival['name']} does not ({spans})"


def _why_latency(win: dict, rival: dict) -> str:
    """Rule 3 between two configurations, in numbers."""
    t_win, t_rival = _r(win, "p95_ttft_ms"), _r(rival, "p95_ttft_ms")
    if t_rival > min(t_win, t_rival) * (1 + TTFT_TOLERANCE):
        return (f"{rival['name']}'s TTFT p95 is {t_rival / t_win - 1:.0%} higher "
                f"(more than {TTFT_TOLERANCE:.0%})")
    i_win, i_rival = _r(win, "p95_itl_ms"), _r(rival, "p95_itl_ms")
    if i_rival > i_win * (1 + TIE):
        return f"{win['name']} has the lower ITL p95 ({1 - i_win / i_rival:.0%} lower)"
    return (f"ITL p95 within {TIE:.0%}, {win['name']} makes more output tok/s per device "
            f"({_output_per_device(win):.2f} vs {_output_per_device(rival):.2f})")


def recommend(entries: list[dict]) -> dict:
    """Apply the module's rules to compare entries.

    Returns ``{"choice": name | None, "split": bool | None, "rule": str, "meets_slos":
    bool | None, "elastic_switches": the winner's role switches when it is elastic (else
    absent or None), "slos_ms": {metric: ms}, "slos_default": bool, "basis": "per core" |
    "per GPU" | "per device" | "per USD", "n": requests per run, "runs": runs per
    configuration, "cannot_tell_apart": [names] ([] when the leader stands alone), "slos":
    str, "evidence": str (n, runs, spread), "reasons": [str, ...], "not_considered": {name:
    why}}``; ``choice`` (and ``meets_slos``) is None when no configuration completed a
    request. Never raises on missing optional fields (breakdown, resources, server trace,
    spread).
    """
    cands, not_considered = _candidates(entries)
    basis = _basis(cands) if cands else "device"
    unit = unit_label(cands, basis)
    judged = [figures(e) for e in cands]
    slos = next((f["slos_ms"] for f in judged if f["slos_ms"]), metrics.DEFAULT_SLOS_MS)
    default = next((f["slos_default"] for f in judged if f["slos_ms"]), True)
    out = {"choice": None, "split": None, "meets_slos": None, "slos_ms": dict(slos),
           "slos_default": default, "basis": unit, "n": _n(cands), "runs": _runs(cands),
           "cannot_tell_apart": [], "rule": _rule(unit), "slos": _slos_line(slos, default, unit),
           "evidence": "", "reasons": [], "not_considered": not_considered}
    if not cands:
        out["reasons"].append("No configuration completed a request; nothing to recommend.")
        return out
    win, tied = choose(cands, basis)
    switches = ((win.get("role_switches") or {}).get("count") or 0) if win.get("mode") == "elastic" else None
    out.update(choice=win["name"], split=win.get("mode") in SPLIT_MODES, elastic_switches=switches,
               cannot_tell_apart=[e["name"] for e in tied],
               meets_slos=any((f["request_goodput"] or 0) > 0 for f in judged),
               evidence=_evidence(cands, basis, unit))
    reasons = out["reasons"]
    if not out["meets_slos"]:
        reasons.append("No configuration meets the SLOs at this load (goodput 0 in all); "
                       "the choice below is by latency. Lower the rate, add devices or "
                       "relax the SLOs.")
    if len({str(f["slos_ms"]) for f in judged}) > 1:
        reasons.append("Warning: the configurations were measured against different SLOs; "
                       "their goodputs do not compare.")
    reasons.append(_verdict(win, cands, out["split"], basis, unit))
    reasons += _where_time_goes(cands)
    reasons += _overview(cands, basis, not_considered)
    return out


def _rule(unit: str) -> str:
    return (f"highest goodput {unit} (requests/s within the SLOs); those that cannot be told "
            f"apart from the best (ranges over the runs overlap, or within {TIE:.0%} with one "
            f"run) go to the simpler (colocated), then to the lowest ITL p95 among those with "
            f"TTFT p95 within {TTFT_TOLERANCE:.0%} of the best, ties ({TIE:.0%}) to output "
            f"tok/s per device")


def _slos_line(slos: dict, default: bool, unit: str) -> str:
    """Which SLOs judged the goodput, and where they came from."""
    if default:
        return (f"Judged by goodput {unit} against the default SLOs: "
                f"{metrics.describe_slos(slos)}; pass --goodput to set yours.")
    return f"Judged by goodput {unit} against your SLOs (--goodput): {metrics.describe_slos(slos)}."


def _n(cands: list[dict]) -> int | None:
    """Requests measured per run (the same trace for every configuration)."""
    counts = [(e["result"].get("completed") or 0) + (e["result"].get("failed") or 0)
              for e in cands]
    return max(counts, default=None)


def _runs(cands: list[dict]) -> int:
    return min((len(e.get("runs") or [None]) for e in cands), default=1)


def _evidence(cands: list[dict], basis: str, unit: str) -> str:
    """n, the number of runs and the spread of goodput, to weigh the verdict by."""
    n, runs = _n(cands), _runs(cands)
    if runs < 2:
        return (f"n = {n} requests, 1 run per configuration: the spread is unknown, so "
                f"goodputs within {TIE:.0%} count as a tie and larger differences may "
                f"still be noise; run with --repeats 3 to measure it.")
    return (f"n = {n} requests per run, {runs} runs per configuration; goodput {unit}, "
            f"median (min–max): " + "; ".join(f"{e['name']} {_span(e, basis)}" for e in cands)
            + f" {goodput_unit(unit)}.")


def _candidates(entries: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Rule 1: the entries that compete, and why each other one does not."""
    not_considered = {e["name"]: e["error"] for e in entries if "error" in e}
    ran = [e for e in entries if "result" in e]
    for e in ran:
        if not e["result"].get("completed"):
            not_considered[e["name"]] = "no request completed"
    cands = [e for e in ran if e["result"].get("completed")]
    clean = [e for e in cands if not _failures(e)]
    for e in cands:
        if clean and e not in clean:
            not_considered[e["name"]] = _failures(e)
    return clean or cands, not_considered


def _failures(e: dict) -> str:
    """What went wrong in any run of an entry ('' when nothing): failed requests (the most
    of any run) and failed runs."""
    most = ((e.get("spread") or {}).get("failed") or [0, e["result"].get("failed") or 0])[1]
    why = [f"{most} failed requests"] if most else []
    if e.get("failed_runs"):
        why.append(f"{len(e['failed_runs'])} failed runs ({e['failed_runs'][0]})")
    return ", ".join(why)


def _verdict(win: dict, cands: list[dict], split: bool, basis: str, unit: str) -> str:
    """The winner against the best of the other kind (split vs not), in numbers."""
    others = [e for e in cands if (e.get("mode") in SPLIT_MODES) != split]
    if not others:
        kind = "elastic" if win.get("mode") == "elastic" else "PD" if split else "colocated"
        return f"Use {win['name']} (the only kind measured: {kind})."
    rival, _ = choose(others, basis)
    verdict = (f"{win['name']} vs {rival['name']} {_devices_text(win, rival)}: "
               f"{_why(win, rival, basis, unit)}; ITL p50 {_ms(_r(win, 'median_itl_ms'))} "
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
            + (f", {kv / 1e6:.1f} MB of KV per request (mean)" if kv else "")
            + f"; {_largest(h, 'the gap')}"
            + ("; other is the decode worker's first step, batched with the running "
               "requests, plus IPC hops." if max(h["mean"], key=h["mean"].get) == "other"
               else "."))


def _overview(cands: list[dict], basis: str, not_considered: dict[str, str]) -> list[str]:
    """Every candidate's ITL tail, goodput (per device, per USD given prices, with the
    leader of each) and resources side by side; who was left out."""
    reasons = ["ITL p95 / p99 and stalls (gaps > 1 s): " + "; ".join(
        f"{e['name']} {_ms(_r(e, 'p95_itl_ms'))} / {_ms(_r(e, 'p99_itl_ms'))} ms, "
        f"{e.get('itl_stalls', 0)} stalls" for e in cands) + "."]
    bases = ["device"] + (["usd"] if any(figures(e)["price_per_hour"] for e in cands) else [])
    for b in bases:
        have = [e for e in cands if figures(e)[f"goodput_per_{b}"] is not None] or cands
        lead = max(have, key=lambda e: _score(e, b))
        unit = unit_label(cands, b)
        reasons.append(f"Goodput {unit} (share of requests within the SLOs): " + "; ".join(
            f"{e['name']} {_span(e, b)} {goodput_unit(unit)} "
            f"({figures(e)['slo_attainment'] or 0:.0%})" for e in have)
            + f"; {lead['name']} leads {unit}.")
    if basis == "device" and unit_label(cands) == "per device":
        reasons.append("Per device compares CPU cores with GPUs; give each deployment's "
                       "price_per_hour to compare per USD.")
    reasons.append("Resources: " + "; ".join(
        f"{e['name']} {devices(e)[1] or '?'} {devices(e)[0]}s, "
        f"{_output_per_device(e):.2f} output tok/s per {devices(e)[0]}" for e in cands) + ".")
    reasons += [f"Not considered: {name} ({why})." for name, why in not_considered.items()]
    return reasons
