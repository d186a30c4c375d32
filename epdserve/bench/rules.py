"""Which configuration to use: the rules, a pure function of the compare entries (the words
that explain the choice: :mod:`epdserve.bench.recommend`).

Input: the entries of ``compare.json`` (:func:`epdserve.bench.compare.run_config`, or
:func:`epdserve.bench.repeats.combine` over repeated runs: ``name``, ``mode`` ("colocated",
"pd" or "epd"), ``result`` (bench result, ms fields), ``resources`` (``num_cores``, and from
a deployments file ``device_kind`` "core" | "GPU", ``num_devices``, ``price_per_hour`` in
USD), ``itl_stalls``, ``breakdown``, ``server``, ``per_run`` (each run's per-request
outcomes, :func:`epdserve.bench.paired.outcomes`), with repeats ``runs`` and ``spread``),
or ``{"name", "error"}`` for a configuration that did not run.

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
   Every other candidate is compared with the leader request by request
   (:mod:`epdserve.bench.paired`: the same requests, the runs paired in order; a 95 %
   confidence interval of the goodput difference by a paired bootstrap over requests and
   runs). Those whose interval lies within :data:`~epdserve.bench.paired.TIE_BAND` (a tie)
   or does not exclude zero (no difference shown at this n) cannot be told apart from the
   leader: the recommendation says so and does not pick by noise: among them the simpler,
   colocated (one kind of worker, no KV hand-off), is preferred, then rule 3. Entries
   without per-request outcomes (``per_run``) fall back to their [min, max] ranges over
   the runs, or to :data:`TIE` with one run, and say that no interval backs them.
   Overload: when every candidate serves fewer than :data:`MOST` of its requests within
   the SLOs, goodput does not rank them; the recommendation says so and what to do, and
   ranks by capacity (the highest rate within the SLOs per device) when every candidate
   has a ``--sweep-rates`` result, else by the paired per-request E2EL (the one that
   drains the load sooner), saying which; what that measure cannot separate goes to the
   simpler. When no candidate has goodput > 0 and no measure separates them, rule 3
   picks among all.
3. Latency: among the candidates whose TTFT p95 is within :data:`TTFT_TOLERANCE` of the
   best TTFT p95, the lowest ITL p95 (the stalls users feel while streaming); ITL p95s
   within :data:`TIE` of the lowest are a tie, broken by the higher output tokens/s per
   device.

A split (PD) is worth it when the winner is a PD or EPD configuration (both split prefill
from decode); the recommendation compares it with the best configuration of the other kind
chosen by the same rules (:func:`rival_of`). Deployments of several engines (epdserve, and
vLLM or others from a deployments file: :func:`engine`) are compared as engines: the rival is
the best of another engine, and "the simpler" never decides between engines (a tie between
them goes to rule 3).

:func:`figures` is the one place per-device and per-dollar figures are computed; the
report's table reads them from there.
"""

from __future__ import annotations

from epdserve.bench import metrics, paired

TTFT_TOLERANCE = 0.25  # TTFT p95 up to 25 % above the best still counts as "as fast"
TIE = 0.05  # values within 5 % of each other are a tie (the noise of one run, unmeasured)
MOST = 0.5  # below this share of requests within the SLOs in every candidate: overload
# Modes with prefill and decode on separate workers (elastic: at times); never "the simpler".
SPLIT_MODES = ("pd", "epd", "elastic")
S_PER_HOUR = 3600.0


def value(e: dict, key: str) -> float:
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


def engine(entry: dict) -> str:
    """The engine a deployment runs: "epdserve" for its own (``--configs``, a deployments-file
    ``epdserve`` entry, an entry that does not say), else the file entry's ``engine`` (e.g.
    "vLLM"), else its name (an engine not named is its own)."""
    dep = entry.get("deployment") or {}
    if not dep or dep.get("epdserve"):
        return "epdserve"
    return dep.get("engine") or entry["name"]


def what(entry: dict) -> str:
    """"vLLM, colocated, 2 cores": its engine, kind and devices, as a verdict names it."""
    kind, n = devices(entry)
    return f"{engine(entry)}, {entry.get('mode') or 'kind unknown'}, {n or '?'} {kind}{'s' if n != 1 else ''}"


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


def basis_of(cands: list[dict]) -> str:
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


def _divisor(e: dict, basis: str) -> float:
    """What goodput (req/s) is divided by: devices, or USD per second; 1 when unknown."""
    f = figures(e)
    if basis == "usd":
        return f["price_per_hour"] / S_PER_HOUR if f["price_per_hour"] else 1.0
    return f["num_devices"] or 1.0


def score(e: dict, basis: str) -> float:
    """Goodput per device or per USD (the raw goodput when the divisor is unknown): the
    mean over the runs the verdict pairs (``per_run``), else the entry's goodput."""
    if e.get("per_run"):
        return paired.goodput(e["per_run"], _divisor(e, basis))
    f = figures(e)
    v = f[f"goodput_per_{basis}"]
    return v if v is not None else (f["request_goodput"] or 0.0)


def comparison(a: dict, b: dict, basis: str = "device",
               per_request: bool = False) -> paired.Comparison | None:
    """``a`` against ``b`` request by request (:func:`paired.compare`), per device or per
    USD; None when either entry has no per-request outcomes (``per_run``)."""
    if not (a.get("per_run") and b.get("per_run")):
        return None
    return paired.compare(a["name"], a["per_run"], _divisor(a, basis), b["name"], b["per_run"],
                          _divisor(b, basis), per_request=per_request)


def goodput_range(e: dict, basis: str) -> list[float] | None:
    f = figures(e)
    key = f"goodput_per_{basis}" if f[f"goodput_per_{basis}"] is not None else "request_goodput"
    return f["spread"].get(key)


def cannot_tell_apart(a: dict, b: dict, basis: str = "device") -> bool:
    """True when the goodputs of ``a`` and ``b`` (per device or per USD) differ by no more
    than the noise or than matters: the paired interval of their difference shows a tie
    or no difference (:func:`comparison`); without per-request outcomes, their [min, max] ranges over the
    runs overlap, or, when either has one run only, they are within :data:`TIE`."""
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
    """Rule 3 on a non-empty list."""
    best_ttft = min(value(e, "p95_ttft_ms") for e in cands)
    fast = [e for e in cands if value(e, "p95_ttft_ms") <= best_ttft * (1 + TTFT_TOLERANCE)]
    best_itl = min(value(e, "p95_itl_ms") for e in fast)
    tied = [e for e in fast if value(e, "p95_itl_ms") <= best_itl * (1 + TIE)]
    return max(tied, key=output_per_device)


def overloaded(cands: list[dict]) -> bool:
    """True when every candidate serves fewer than :data:`MOST` of its requests within the
    SLOs: past capacity, where goodput no longer ranks deployments."""
    return bool(cands) and all((figures(e)["slo_attainment"] or 0.0) < MOST for e in cands)


def overload_measure(cands: list[dict]) -> str:
    """What ranks overloaded candidates: "capacity" when every one has a sweep's highest
    rate within the SLOs, else "E2EL" (per request, paired)."""
    ok = all((e.get("sweep") or {}).get("max_rate") is not None for e in cands)
    return "capacity" if ok else "E2EL"


def capacity(e: dict) -> float:
    """The sweep's highest rate within the SLOs per device (req/s)."""
    return e["sweep"]["max_rate"] / (devices(e)[1] or 1)


def e2el_separates(a: dict, b: dict) -> bool:
    """True when ``a``'s per-request E2EL is shown lower than ``b``'s: the paired interval of
    the median difference lies below zero (without per-request outcomes: medians more than
    :data:`TIE` apart)."""
    c = comparison(a, b, per_request=True)
    if c is not None and c.e2el_ms:
        return c.e2el_ms["ci"][1] < 0
    return value(a, "median_e2el_ms") < value(b, "median_e2el_ms") * (1 - TIE)


def _by_overload_measure(cands: list[dict]) -> tuple[dict, list[dict]]:
    """Rule 2 under overload: the leader by capacity per device, or by the lowest E2EL p50;
    those it does not separate from it are tied."""
    if overload_measure(cands) == "capacity":
        leader = max(cands, key=capacity)
        tied = [e for e in cands if capacity(e) >= capacity(leader) * (1 - TIE)]
    else:
        leader = min(cands, key=lambda e: value(e, "median_e2el_ms"))
        tied = [e for e in cands if e is leader or not e2el_separates(leader, e)]
    return leader, tied


def choose(cands: list[dict], basis: str = "device") -> tuple[dict, list[dict]]:
    """(winner, the candidates that cannot be told apart from the leader, [] when the leader
    stands alone or nothing meets the SLOs) of a non-empty candidate list by rule 2
    (goodput, or under overload capacity or E2EL), then 3."""
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


def rival_of(win: dict, cands: list[dict], basis: str) -> dict | None:
    """The best candidate of another engine than ``win``'s, where several engines ran; else
    of the other kind (split vs not); by the same rules. None when only one kind of one
    engine was measured."""
    others = [e for e in cands if engine(e) != engine(win)]
    if not others:
        others = [e for e in cands if (e.get("mode") in SPLIT_MODES) != (win.get("mode") in SPLIT_MODES)]
    return choose(others, basis)[0] if others else None


def settled(cands: list[dict], basis: str) -> dict:
    """``{"settled", "unsettled"}``: the candidates the paired interval neither tells apart
    from the goodput leader nor shows tied with it (more runs may decide them). Overload,
    one candidate or no per-request outcomes: settled (more runs of this load cannot rank
    by goodput, or there is nothing to pair)."""
    if overloaded(cands) or len(cands) < 2:
        return {"settled": True, "unsettled": []}
    leader = max(cands, key=lambda e: score(e, basis))
    pending = [e["name"] for e in cands if e is not leader
               and (c := comparison(leader, e, basis)) is not None and c.verdict == "unresolved"]
    return {"settled": not pending, "unsettled": pending}


def requests_per_run(cands: list[dict]) -> int | None:
    """Requests measured per run (the same trace for every configuration)."""
    counts = [(e["result"].get("completed") or 0) + (e["result"].get("failed") or 0)
              for e in cands]
    return max(counts, default=None)


def runs_per_config(cands: list[dict]) -> int:
    return min((len(e.get("runs") or [None]) for e in cands), default=1)
