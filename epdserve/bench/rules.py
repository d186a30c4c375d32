"""Which configuration to use: the rules, a pure function of compare.json's entries, judged by
goodput with a paired bootstrap interval (:mod:`epdserve.bench.paired`); stated in
docs/comparing.md, "The recommendation". :func:`figures` is the one place per-device and
per-dollar figures are computed."""

from __future__ import annotations

from epdserve.bench import metrics, paired

TTFT_TOLERANCE = 0.25  # TTFT p95 up to 25 % above the best still counts as "as fast"
TIE = 0.05  # values within 5 % are a tie (one run's noise, unmeasured)
MOST = 0.5  # below this share of requests within the SLOs in every candidate: overload
# Prefill and decode on separate workers (elastic: at times); never "the simpler".
SPLIT_MODES = ("pd", "epd", "elastic")
S_PER_HOUR = 3600.0


def value(e: dict, key: str) -> float:
    v = e["result"].get(key)
    return float(v) if isinstance(v, (int, float)) else float("nan")


def devices(entry: dict) -> tuple[str, int | None]:
    """(device kind "core" or "GPU", count or None when unknown)."""
    res = entry.get("resources") or {}
    kind = res.get("device_kind") or "core"
    n = res.get("num_devices") or (res.get("num_cores") if kind == "core" else None)
    return kind, n


def engine(entry: dict) -> str:
    """"epdserve" for its own deployments, else the entry's ``engine``, else its name."""
    dep = entry.get("deployment") or {}
    if not dep or dep.get("epdserve"):
        return "epdserve"
    return dep.get("engine") or entry["name"]


def what(entry: dict) -> str:
    kind, n = devices(entry)
    return f"{engine(entry)}, {entry.get('mode') or 'kind unknown'}, {n or '?'} {kind}{'s' if n != 1 else ''}"


def figures(entry: dict) -> dict:
    """Goodput (req/s), attainment, output tok/s, each per device and per USD (None when the
    device count or price is unknown), with ``spread`` ([min, max]) for entries with repeats."""
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


def basis_of(cands: list[dict]) -> str:
    return "usd" if all(figures(e)["price_per_hour"] for e in cands) else "device"


def unit_label(entries: list[dict], basis: str = "device") -> str:
    if basis == "usd":
        return "per USD"
    kinds = {devices(e)[0] for e in entries}
    return f"per {kinds.pop()}" if len(kinds) == 1 else "per device"


def goodput_unit(unit: str) -> str:
    return "requests per USD" if unit == "per USD" else f"req/s {unit}"


def _divisor(e: dict, basis: str) -> float:
    """Devices, or USD per second; 1 when unknown."""
    f = figures(e)
    if basis == "usd":
        return f["price_per_hour"] / S_PER_HOUR if f["price_per_hour"] else 1.0
    return f["num_devices"] or 1.0


def score(e: dict, basis: str) -> float:
    """Goodput per device or USD (raw goodput when unknown), over the paired runs if any."""
    if e.get("per_run"):
        return paired.goodput(e["per_run"], _divisor(e, basis))
    f = figures(e)
    v = f[f"goodput_per_{basis}"]
    return v if v is not None else (f["request_goodput"] or 0.0)


def comparison(a: dict, b: dict, basis: str = "device",
               per_request: bool = False) -> paired.Comparison | None:
    """None when either entry has no per-request outcomes (``per_run``)."""
    if not (a.get("per_run") and b.get("per_run")):
        return None
    return paired.compare(a["name"], a["per_run"], _divisor(a, basis), b["name"], b["per_run"],
                          _divisor(b, basis), per_request=per_request)


def goodput_range(e: dict, basis: str) -> list[float] | None:
    f = figures(e)
    key = f"goodput_per_{basis}" if f[f"goodput_per_{basis}"] is not None else "request_goodput"
    return f["spread"].get(key)


def cannot_tell_apart(a: dict, b: dict, basis: str = "device") -> bool:
    """The paired interval shows a tie or no difference; without per-request outcomes,
    the runs' ranges overlap, or with one run the goodputs are within :data:`TIE`."""
    c = comparison(a, b, basis)
    if c is not None:
        return c.verdict in ("tie", "unresolved")
    ra, rb = goodput_range(a, basis), goodput_range(b, basis)
    if ra and rb:
        return ra[0] <= rb[1] and rb[0] <= ra[1]
    sa, sb = score(a, basis), score(b, basis)
    return min(sa, sb) >= max(sa, sb) * (1 - TIE)


def output_per_device(e: dict) -> float:
    f = figures(e)
    return f["output_per_device"] or f["output_throughput"] or 0.0


def _by_latency(cands: list[dict]) -> dict:
    """Rule 3."""
    best_ttft = min(value(e, "p95_ttft_ms") for e in cands)
    fast = [e for e in cands if value(e, "p95_ttft_ms") <= best_ttft * (1 + TTFT_TOLERANCE)]
    best_itl = min(value(e, "p95_itl_ms") for e in fast)
    tied = [e for e in fast if value(e, "p95_itl_ms") <= best_itl * (1 + TIE)]
    return max(tied, key=output_per_device)


def overloaded(cands: list[dict]) -> bool:
    return bool(cands) and all((figures(e)["slo_attainment"] or 0.0) < MOST for e in cands)


def overload_measure(cands: list[dict]) -> str:
    ok = all((e.get("sweep") or {}).get("max_rate") is not None for e in cands)
    return "capacity" if ok else "E2EL"


def capacity(e: dict) -> float:
    """The sweep's highest rate within the SLOs, req/s per device."""
    return e["sweep"]["max_rate"] / (devices(e)[1] or 1)


def e2el_separates(a: dict, b: dict) -> bool:
    """The paired interval of the median E2EL difference lies below zero (without outcomes:
    medians more than :data:`TIE` apart)."""
    c = comparison(a, b, per_request=True)
    if c is not None and c.e2el_ms:
        return c.e2el_ms["ci"][1] < 0
    return value(a, "median_e2el_ms") < value(b, "median_e2el_ms") * (1 - TIE)


def _by_overload_measure(cands: list[dict]) -> tuple[dict, list[dict]]:
    if overload_measure(cands) == "capacity":
        leader = max(cands, key=capacity)
        tied = [e for e in cands if capacity(e) >= capacity(leader) * (1 - TIE)]
    else:
        leader = min(cands, key=lambda e: value(e, "median_e2el_ms"))
        tied = [e for e in cands if e is leader or not e2el_separates(leader, e)]
    return leader, tied


def choose(cands: list[dict], basis: str = "device") -> tuple[dict, list[dict]]:
    """(winner, candidates not told apart from the leader, [] when it stands alone)."""
    if overloaded(cands):
        leader, tied = _by_overload_measure(cands)
    else:
        leader = max(cands, key=lambda e: score(e, basis))
        if score(leader, basis) <= 0:
            return _by_latency(cands), []
        tied = [e for e in cands if e is leader or cannot_tell_apart(e, leader, basis)]
    # The simpler wins among kinds of one engine; between engines only the interval decides.
    one_engine = len({engine(e) for e in tied}) == 1
    simple = [e for e in tied if e.get("mode") not in SPLIT_MODES] if one_engine else []
    return _by_latency(simple or tied), tied if len(tied) > 1 else []


def candidates(entries: list[dict]) -> tuple[list[dict], dict[str, str]]:
    """Rule 1: (competing entries, {name: why not} for the others)."""
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
    most = ((e.get("spread") or {}).get("failed") or [0, e["result"].get("failed") or 0])[1]
    why = [f"{most} failed requests"] if most else []
    if e.get("failed_runs"):
        why.append(f"{len(e['failed_runs'])} failed runs ({e['failed_runs'][0]})")
    return ", ".join(why)


def rival_of(win: dict, cands: list[dict], basis: str) -> dict | None:
    """The best of another engine, else of the other kind (split or not); None if none."""
    others = [e for e in cands if engine(e) != engine(win)]
    if not others:
        others = [e for e in cands if (e.get("mode") in SPLIT_MODES) != (win.get("mode") in SPLIT_MODES)]
    return choose(others, basis)[0] if others else None


def settled(cands: list[dict], basis: str) -> dict:
    """Unsettled: candidates the interval neither tells apart from the leader nor shows tied.
    Overload, one candidate or nothing to pair count as settled."""
    if overloaded(cands) or len(cands) < 2:
        return {"settled": True, "unsettled": []}
    leader = max(cands, key=lambda e: score(e, basis))
    pending = [e["name"] for e in cands if e is not leader
               and (c := comparison(leader, e, basis)) is not None and c.verdict == "unresolved"]
    return {"settled": not pending, "unsettled": pending}


def requests_per_run(cands: list[dict]) -> int | None:
    counts = [(e["result"].get("completed") or 0) + (e["result"].get("failed") or 0)
              for e in cands]
    return max(counts, default=None)


def runs_per_config(cands: list[dict]) -> int:
    return min((len(e.get("runs") or [None]) for e in cands), default=1)
