"""What ``epdserve plan`` writes: ``plan.md`` (:func:`markdown`) and ``goodput.png`` (:func:`plot`)."""

from __future__ import annotations

from pathlib import Path

from epdserve import extras
from epdserve.plan import replay
from epdserve.plan.validation import VALIDATED


def fmt(v, spec: str = ".3g") -> str:
    return "—" if v is None else format(v, spec)


def _validation_line(v: dict) -> str:
    errs = ", ".join(f"{k} {v['max_abs_error'][k]:.0%}" for k in VALIDATED)
    dirs = v["compare_dirs"]
    line = f"- {', '.join(f'`{d}`' for d in dirs)} ({v['date']}, {len(v['rows'])} deployments): largest |error| {errs}."
    if len(dirs) > 1:
        spread = ", ".join(f"{k} {v['max_spread'][k]:.0%}" for k in VALIDATED)
        line += f" The same trace measured {len(dirs)} times moved by up to {spread} (max - min over mean)."
    if v["step_uncertainty"]:
        line += (f" With step times {v['step_uncertainty']:.0%} faster or slower, the prediction's band held "
                 f"{v['in_band']} of {v['values']} measured latencies.")
    return line


def markdown(doc: dict) -> str:
    slos = " ".join(f"{k} ≤ {v:g} ms" for k, v in doc["slos_ms"].items())
    lines = [f"# Plan: {doc['platform']}, {doc['devices']} device{'s' if doc['devices'] > 1 else ''}", "",
             f"Workload: {doc['workload']}. SLOs: {slos} for {doc['target']:.0%} of requests (goodput as "
             f"DistServe defines it).", "",
             "| deployment | devices | goodput req/s | per device | TTFT p50/p95 ms | ITL p50/p95 ms "
             "| out tok/s/device | USD / M out tokens | replay |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["candidates"]:
        band = " ({} – {})".format(*map(fmt, r["goodput_band_rps"])) if "goodput_band_rps" in r else ""
        at_least = "≥ " if r["unbounded"] else ""
        lines.append(f"| {r['name']} | {r['devices']} | {at_least}{fmt(r['max_goodput_rps'])}"
                     f"{_seed_band(r, 'max_goodput_rps')}{band} | "
                     f"{at_least}{fmt(r['goodput_per_device'])}{_seed_band(r, 'goodput_per_device')} | "
                     f"{fmt(r['p50_ttft_ms'], '.0f')} / {fmt(r['p95_ttft_ms'], '.0f')}"
                     f"{_seed_band(r, 'p95_ttft_ms', '.0f')} | "
                     f"{fmt(r['p50_itl_ms'], '.1f')} / {fmt(r['p95_itl_ms'], '.1f')}"
                     f"{_seed_band(r, 'p95_itl_ms', '.1f')} | "
                     f"{fmt(r['output_tok_s_per_device'])} | "
                     f"{fmt(r['usd_per_m_output_tokens'])} | {_replay_cell(r)} |")
    lines += [f"| {name} | skipped: {why} ||||||||" for name, why in doc["skipped"].items()]
    lines += ["", _replay_note(doc.get("replay", "steady")), ""]
    if "seeds" in doc:
        lines += [seeds_note(doc), ""]
    lines += [f"**Recommendation: {doc['recommendation'] or 'none'}** — {doc['reason']}.", ""]
    lines += elastic_lines(doc["candidates"])
    if unbounded := [r["name"] for r in doc["candidates"] if r["unbounded"]]:
        lines += [f"≥: {', '.join(unbounded)} met the SLOs at every rate tried, the whole trace in flight at "
                  f"once: the trace is too short to find their goodput; plan with more requests.", ""]
    if any("goodput_band_rps" in r for r in doc["candidates"]):
        lines += [f"Goodput in brackets: with every step {doc['step_uncertainty']:.0%} faster or slower, the "
                  f"spread of the served runs this machine's serving slowdown was fitted on.", ""]
    if doc.get("validations"):
        lines.append("Prediction errors at the last validation of each workload:")
        lines += [_validation_line(v) for v in doc["validations"]]
    elif doc["platform"].endswith("this CPU"):
        lines.append("Not validated yet: run `epdserve compare`, then `epdserve plan validate --compare-dir DIR`.")
    else:
        lines.append("Roofline estimate from datasheet peaks and efficiency factors; not validated "
                     "against measurements on this hardware.")
    return "\n".join(lines) + "\n"


# Decisions listed per elastic deployment in plan.md; plan.json has them all.
MAX_DECISION_LINES = 20


def elastic_lines(rows: list[dict]) -> list[str]:
    """A line per decision that changed roles (s from the start), then holds; of the plan
    row's goodput rate, or a validate row's own trace."""
    lines = []
    for row in rows:
        rep = row.get("elastic")
        if rep is None:
            continue
        decisions = rep["decisions"]
        where = f"at {fmt(row['max_goodput_rps'])} req/s" if "max_goodput_rps" in row else "on the run's trace"
        lines += [f"Elastic **{row['name']}** (the simulated controller {where}): "
                  f"{len(decisions)} role change(s), {rep['holds']} holds; roles at the end: "
                  + ", ".join(f"{w} {r}" for w, r in rep["roles"].items()) + ".", ""]
        ends = [d["t"] for d in decisions[1:]] + [float("inf")]
        for d, end in list(zip(decisions, ends))[:MAX_DECISION_LINES]:
            drains = ", ".join(f"{e['worker']} {e['drain_ms'] / 1e3:.1f} s" for e in rep["role_events"]
                               if e["state"] == "switched" and d["t"] <= e["t"] < end)
            roles = ", ".join(f"{w} {r}" for w, r in d["roles"].items())
            lines.append(f"- +{d['t']:.1f} s {d['action']} ({roles}): {d['reason']}"
                         + (f"; drained: {drains}" if drains else ""))
        if len(decisions) > MAX_DECISION_LINES:
            lines.append(f"- ... {len(decisions) - MAX_DECISION_LINES} more in plan.json")
        if rep["last_hold"]:
            lines.append(f"- last hold: {rep['last_hold']}")
        lines.append("")
    return lines


def _seed_band(row: dict, key: str, spec: str = ".3g") -> str:
    band = (row.get("seed_band") or {}).get(key)
    return " [{}–{}]".format(*(fmt(v, spec) for v in band)) if band and len(row.get("seeds") or ()) > 1 else ""


def seeds_note(doc: dict) -> str:
    seeds = doc["seeds"]
    if doc.get("arrivals") == "trace":
        return ("Arrivals: the trace's own, scaled to each rate: one arrival sequence, each deployment simulated on "
                "it once, so no band over seeds (`--seeds` applies to a trace sent all at once, which gets seeded "
                "Poisson arrivals).")
    if len(seeds) == 1:
        return (f"Arrivals: Poisson, one seed ({seeds[0]}): one sample, no band; `--seeds N` simulates N arrival "
                f"sequences and gives each figure's spread.")
    return (f"Square brackets: min–max over {len(seeds)} arrival seeds ({seeds[0]} to {seeds[-1]}: Poisson arrivals "
            f"of the same requests); each figure is the median over the seeds of that seed's figure at its own "
            f"goodput rate (plan.json: `per_seed` and `seed_band` of every figure). The replay column, goodput.png "
            f"and an elastic controller are the median seed's.")


def _replay_cell(row: dict) -> str:
    copies = row.get("replay_copies")
    cell = "once" if copies is None else f"{copies} copies, {'steady' if row['steady_state'] else 'not steady'}"
    if row.get("above_rate_rps") is not None:
        why = "queue grows" if row["above_steady_state"] is False else f"{row['above_slo_attainment']:.1%} in SLOs"
        cell += f"; {row['above_rate_rps']:.3g} req/s: {why}"
    return cell


def _replay_note(mode: str) -> str:
    if mode == "once":
        return ("Replay: the trace once per rate, as `epdserve compare --sweep-rates` sends it; a trace too short "
                "to build a queue makes this goodput optimistic.")
    return (f"Replay: at each rate the trace was sent back to back, copy after copy (a trace sent all at once: "
            f"repeated to {replay.MIN_POISSON_COPY} Poisson arrivals a copy), until the mean number of requests in "
            f"flight changed by at most {replay.TOLERANCE:.0%} of itself and of a copy's requests from one copy to "
            f"the next (at most {replay.MAX_COPIES} copies or {replay.MAX_REQUESTS} requests), and measured on the "
            f"last two copies, never the first (the warm-up). A rate whose queue keeps growing fails. The column "
            f"gives the copies at the goodput rate, then the next rate tried above it and why it failed.")


def plot(curves: dict[str, list[dict]], target: float, path: Path) -> bool:
    """``curves``: points ``{"rate", "slo_attainment", "steady_state"}``, unsteady ones drawn as an x at
    0. False (after one warning line) without matplotlib."""
    try:
        plt = extras.pyplot()  # only here: plotting is slow to import and only plan search draws
    except extras.MissingExtra as exc:
        extras.warn_skipped(exc)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        if points:
            (line,) = ax.plot([p["rate"] for p in points], [p["slo_attainment"] for p in points], marker="o",
                              label=name)
            grows = [p["rate"] for p in points if p.get("steady_state") is False]
            if grows:
                ax.plot(grows, [0.0] * len(grows), "x", color=line.get_color(), markersize=9)
                ax.set_title("x: the queue keeps growing (the rate is not sustained)", fontsize=8)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("share of requests meeting the SLOs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
