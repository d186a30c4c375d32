"""compare's side-by-side table (text and markdown) and compare.md, from compare.json's entries.
Columns: the configurations ("median (min–max)" over repeats), then "x of BASELINE" ratios;
entries with an ``error`` get no column."""

from __future__ import annotations

import textwrap
from typing import Sequence

from epdserve.bench import metrics, production, rules, server_metrics, tables
from epdserve.bench.server_trace import FIELDS, sort_parts

# (label, better, where, key, format, scale). where: "result", "server" (trace means per
# request), "figures" (rules.figures), "devices" (key: the device kind) or "entry";
# "{unit}" is "per core", "per GPU" or "per device".
ROWS = [
    ("TTFT p50 (ms)", "lower", "result", "median_ttft_ms", "{:.1f}", 1),
    ("TTFT p95 (ms)", "lower", "result", "p95_ttft_ms", "{:.1f}", 1),
    ("TTFT p99 (ms)", "lower", "result", "p99_ttft_ms", "{:.1f}", 1),
    ("ITL p50 (ms)", "lower", "result", "median_itl_ms", "{:.1f}", 1),
    ("ITL p95 (ms)", "lower", "result", "p95_itl_ms", "{:.1f}", 1),
    ("ITL p99 (ms)", "lower", "result", "p99_itl_ms", "{:.1f}", 1),
    ("TPOT p50 (ms)", "lower", "result", "median_tpot_ms", "{:.1f}", 1),
    ("E2EL p50 (ms)", "lower", "result", "median_e2el_ms", "{:.1f}", 1),
    ("E2EL p95 (ms)", "lower", "result", "p95_e2el_ms", "{:.1f}", 1),
    ("Output tok/s", "higher", "result", "output_throughput", "{:.2f}", 1),
    ("Requests/s", "higher", "result", "request_throughput", "{:.3f}", 1),
    ("Goodput (req/s within the SLOs)", "higher", "figures", "request_goodput", "{:.3f}", 1),
    ("SLO attainment (% of requests)", "higher", "figures", "slo_attainment", "{:.0%}", 1),
    ("ITL stalls (gaps > 1 s)", "lower", "entry", "itl_stalls", "{:d}", 1),
    ("Failed requests", "lower", "result", "failed", "{:d}", 1),
    ("Peak memory (GiB, resident)", "lower", "entry", "memory_peak_bytes", "{:.2f}", 2 ** -30),
    ("Cores", "", "devices", "core", "{:d}", 1),
    ("GPUs", "", "devices", "GPU", "{:d}", 1),
    ("Output tok/s {unit}", "higher", "figures", "output_per_device", "{:.2f}", 1),
    ("Goodput req/s {unit}", "higher", "figures", "goodput_per_device", "{:.3f}", 1),
    ("Price (USD/h)", "lower", "figures", "price_per_hour", "{:.2f}", 1),
    ("Goodput requests per USD", "higher", "figures", "goodput_per_usd", "{:,.1f}", 1),
    ("Output tokens per USD", "higher", "figures", "output_per_usd", "{:,.0f}", 1),
    ("KV per request (MB, mean)", "lower", "server", "mean_kv_bytes", "{:.2f}", 1e-6),
    ("KV transfer per request (ms, mean)", "lower", "server", "mean_kv_transfer_ms",
     "{:.2f}", 1),
    # over TCP between two nodes; absent when every hand-off stayed on its node
    ("KV per cross-node request (MB, mean)", "lower", "server", "mean_kv_bytes_cross_node", "{:.2f}", 1e-6),
    ("KV transfer per cross-node request (ms, mean)", "lower", "server", "mean_kv_transfer_ms_cross_node",
     "{:.2f}", 1),
    # over the requests with images
    ("Embeddings per request (MB, mean)", "lower", "server", "mean_embedding_bytes",
     "{:.3f}", 1e-6),
    ("Embedding transfer per request (ms, mean)", "lower", "server",
     "mean_embedding_transfer_ms", "{:.2f}", 1),
    ("Embeddings per image (MB, mean)", "lower", "server", "mean_embedding_bytes_per_image",
     "{:.3f}", 1e-6),
    ("Encode per request (ms, mean)", "lower", "server", "mean_encode_ms", "{:.1f}", 1),
]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def value(entry: dict, where: str, key: str) -> tuple[float | None, list | None]:
    """(cell value or None, its [min, max] over runs or None), unscaled."""
    if where == "devices":
        kind, n = rules.devices(entry)
        return (n if kind == key else None), None
    if where == "figures":
        f = rules.figures(entry)
        return f.get(key), f["spread"].get(key)
    v = ((entry.get(where) if where != "entry" else entry) or {}).get(key)
    spread = (entry.get("spread") or {}).get(key) if where in ("result", "entry") else None
    return (v if _number(v) else None), spread


def _cell(fmt: str, v: float) -> str:
    """A median count that is not whole gets a decimal."""
    if fmt == "{:d}" and not float(v).is_integer():
        return f"{v:.1f}"
    return fmt.format(int(v) if fmt == "{:d}" else v)


def table(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows; rows absent in every configuration (e.g. prices) are left out."""
    entries = [e for e in entries if "result" in e]
    names = [e["name"] for e in entries]
    header = ["Metric", "Better", *names, *(f"{n} (x of {names[0]})" for n in names[1:])]
    unit = rules.unit_label(entries)
    rows = []
    for label, better, where, key, fmt, scale in ROWS:
        cells = [value(e, where, key) for e in entries]
        if all(v is None for v, _ in cells):
            continue
        texts = [("—" if v is None else _cell(fmt, v * scale))
                 + (f" ({_cell(fmt, r[0] * scale)}–{_cell(fmt, r[1] * scale)})" if r and
                    v is not None else "") for v, r in cells]
        base = cells[0][0]
        texts += [f"{v / base:.2f}x" if v is not None and base else "—" for v, _ in cells[1:]]
        rows.append([label.format(unit=unit), better or "—", *texts])
    return header, rows


def caption(entries: list[dict]) -> str:
    ran = [e for e in entries if "result" in e]
    if not ran:
        return ""
    judged = rules.figures(ran[0])
    slos = judged["slos_ms"] or metrics.DEFAULT_SLOS_MS
    runs = min(len(e.get("runs") or [None]) for e in ran)
    which = "the default SLOs" if judged["slos_default"] or not judged["slos_ms"] else "your SLOs"
    return " ".join([
        "Latencies are client-side percentiles over the requests (p50 = median; ITL over "
        "every gap between streamed chunks, pooled), as vLLM's `bench serve` measures them; "
        "throughputs are over the run's duration.",
        f"Goodput = requests/s meeting every SLO ({which}: {metrics.describe_slos(slos)}).",
        f"Each cell is the median of {runs} runs (min–max)." if runs > 1 else
        "One run per configuration: the verdict's interval is over its requests only (more "
        "runs, --repeats, also cover run-to-run noise).",
        f"\"x of {ran[0]['name']}\" = the value ÷ {ran[0]['name']}'s; Better says which "
        "direction wins on that row (lower: under 1.00x is better; higher: over 1.00x is "
        "better).",
        "KV and encode rows are server-trace means per request."])


def text_table(entries: list[dict]) -> str:
    return "\n".join([*textwrap.wrap(caption(entries), 100), "",
                      tables.text(*table(entries), left=2)])


def markdown_table(entries: list[dict]) -> str:
    return tables.markdown(*table(entries), left=2)


def workload_lines(spec: dict, summary: dict) -> list[str]:
    fmt = lambda v: f"{v[0]}:{v[1]}" if isinstance(v, list) else str(v)  # noqa: E731  (ranges)
    params = ", ".join(f"{k}={fmt(v)}" for k, v in spec.items() if k not in ("source", "replay", "phase_windows"))
    lines = [f"- generator: {spec.get('source', '?')}" + (f" ({params})" if params else ""),
             f"- {summary['num_requests']} requests, sent over "
             f"{summary['duration_of_arrivals_s']:.1f} s"]
    windows = spec.get("phase_windows")
    for k, (first, n, start, end) in enumerate(zip(*(windows[c] for c in ("first", "n", "start_s", "end_s")))
                                               if windows else ()):
        lines.append(f"- phase {k + 1}: requests {first}–{first + n - 1}, sent {start:.1f}–{end:.1f} s")
    if summary.get("num_images"):
        lines.append(f"- {summary['num_images']} images ({summary['distinct_images']} "
                     f"distinct), seeded synthetic JPEGs sent as data URLs")
    for kind in ("chat", "long"):
        k = summary.get(kind)
        if k:
            line = (f"- {kind}: {k['count']} requests, prompt {k['prompt_tokens'][0]}–"
                    f"{k['prompt_tokens'][1]} tokens ({k['total_prompt_tokens']:,} in all), "
                    f"output {k['max_tokens'][0]}–{k['max_tokens'][1]} tokens "
                    f"({k['total_max_tokens']:,} in all)")
            if k.get("offsets_s"):
                line += ", sent at " + ", ".join(f"{x:.1f}" for x in k["offsets_s"]) + " s"
            lines.append(line)
    lines.append("- prompt token counts are of the message text; the server adds its chat "
                 "template")
    if spec.get("replay"):
        lines += ["", *production.replay_lines(spec["replay"])]
    return lines


def breakdown_markdown(entries: list[dict], which: str) -> str:
    """Mean and p95 (ms) of each part of TTFT (``which`` "ttft") or of the PD hand-off gap
    ("handoff"), the first run's with repeats, and the sum of means; '' without breakdowns."""
    have = [e for e in entries if ((e.get("breakdown") or {}).get(which))]
    if not have:
        return ""
    parts = sort_parts((p for e in have for p in e["breakdown"][which]["parts"]), which)
    header = ["Part (ms)"] + [f"{e['name']} {s}" for e in have for s in ("mean", "p95")]
    rows = []
    for part in parts:
        cells = []
        for e in have:
            b = e["breakdown"][which]
            # + 0.0 turns a rounded -0.0 (a remainder that is float noise) into 0.0
            cells += [f"{round(b[s][part], 1) + 0.0:,.1f}" if part in b[s] else "—"
                      for s in ("mean", "p95")]
        rows.append([part, *cells])
    total = []
    for e in have:
        b = e["breakdown"][which]
        total += [f"**{sum(b['mean'].values()):,.1f}**", f"n={b['n']}"]
    rows.append(["**sum of the means (client)**", *total])
    return tables.markdown(header, rows)


def recommendation_markdown(rec: dict, disturbed: Sequence[str] = ()) -> str:
    """"## Recommendation": headline (qualified when ``disturbed`` runs had outside
    load), SLOs and evidence, the SLO map's region, reasons, rule."""
    head = rec["headline"]
    if disturbed and rec["choice"]:
        head += (f" **But other processes loaded the cores during {len(disturbed)} run(s)** "
                 f"({disturbed[0]}): measure again on a quiet machine before acting on it.")
    basis = " ".join(x for x in (rec.get("slos"), rec.get("evidence"), rec.get("stopped")) if x)
    region = [f"Who wins at other SLOs (the map below, slo_map.png): {rec['region']}.", ""] if rec.get("region") else []
    return "\n".join(["## Recommendation", "", head, "", *([basis, ""] if basis else []), *region,
                      *[f"- {r}" for r in rec["reasons"]], "",
                      f"Rule: {rec['rule']} (epdserve/bench/rules.py)."])


def sweep_markdown(entries: list[dict]) -> str:
    have = [e for e in entries if e.get("sweep")]
    stopped = [f"- {e['name']}: the sweep stopped: {e['sweep_error']}" for e in entries if e.get("sweep_error")]
    if not have and not stopped:
        return ("Not measured. Add `--goodput ttft:MS tpot:MS --sweep-rates LO:HI` to "
                "`epdserve compare` to find each configuration's highest request rate within "
                "the SLOs (goodput_vs_rate.png).")
    lines = []
    for e in have:
        sw = e["sweep"]
        best = (f"{sw['max_rate']:.3g} req/s" if sw["max_rate"] is not None
                else "none of the rates tried (lower LO)")
        if sw["max_rate"] is not None and sw["bracket"][1] is None:
            best += " (the highest rate tried: raise HI)"
        pts = ", ".join(f"{p['rate']:.3g}: {p['slo_attainment']:.0%}" for p in sw["points"])
        kind, n = rules.devices(e)
        per_device = (f" ({sw['max_rate'] / n:.3g} req/s per {kind})"
                      if n and sw["max_rate"] is not None else "")
        lines.append(f"- {e['name']}: max rate with {sw['target_share']:.0%} of requests "
                     f"within the SLOs: {best}{per_device}; attainment by rate: {pts}")
    return "\n".join(lines + stopped)


def load_warnings(entries: list[dict]) -> list[str]:
    return [f"{e['name']}: {e['host_load']['warning']}" for e in entries
            if (e.get("host_load") or {}).get("warning")]


def load_line(load: dict) -> str:
    b, d = load["before"], load["during"]
    fmt = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731  (no /proc/loadavg)
    return (f"- host load on cores {load['cores']}: 1-min load average {fmt(b['loadavg_1m'])} "
            f"before, {fmt(d['loadavg_1m_mean'])} (max {fmt(d['loadavg_1m_max'])}) during the run; "
            f"CPU during the run: deployment {d['deployment_cpu_s']:.1f} s, bench client "
            f"{d['client_cpu_s']:.1f} s, other processes {d['outside_cpu_s']:.1f} s "
            f"({d['outside_share']:.0%} of the cores' time; {b['outside_share']:.0%} in the "
            f"second before), steal {d['steal_share']:.0%}")


def markdown_report(entries: list[dict], workload_spec: dict, trace_summary: dict,
                    sampling: dict | None = None, recommendation: dict | None = None) -> str:
    ran = [e for e in entries if "result" in e]
    parts = ["# epdserve compare", "", caption(ran), "", markdown_table(ran), "",
             "Latencies are measured from the request's send. KV, encode and embedding rows "
             "come from the server trace (mean per request; encode and embedding rows over "
             "the requests with images, embedding size and transfer 0 unless EPD); peak memory is "
             "the resident memory of the deployment's processes (router, workers and their children) "
             "at the highest of the load monitor's 1-s samples during the run (the highest run's "
             "with repeats; unknown for a deployment compare did not start); cores "
             "are the CPU cores the workers were pinned to (from /health), GPUs and prices "
             "those a deployments file gives. Prefix caching is on unless a configuration's "
             "name ends in -noprefix.", ""]
    for e in entries:
        if "error" in e:
            parts += [f"**{e['name']} failed:** `{e['error']}`", ""]
            if e.get("log_tail"):
                parts += ["Last lines of its log:", "", "```", e["log_tail"], "```", ""]
    for line in load_warnings(ran):
        parts += [f"**Warning, the measurement may be disturbed:** {line}.", ""]
    parts += _breakdown_sections(ran)
    parts += ["## Workload", "", *workload_lines(workload_spec, trace_summary)]
    if sampling:
        parts.append("- same trace, model and settings for every configuration: " +
                     ", ".join(f"{k}={v}" for k, v in sampling.items()))
    parts.append("")
    for e in ran:
        parts += _run_section(e)
    stages = server_table_markdown(ran)
    if stages:
        parts += ["## Server-side stages (per request, from the server trace)", "", stages, ""]
    scraped = server_metrics.stages_markdown(ran)
    if scraped:
        parts += ["## Server-side stages from /metrics (deltas over the measured requests)", "",
                  scraped, ""]
    parts += ["## Goodput vs rate", "", sweep_markdown(ran), ""]
    if recommendation:
        parts += [recommendation_markdown(recommendation, load_warnings(ran)), ""]
    return "\n".join(parts)


def _breakdown_sections(ran: list[dict]) -> list[str]:
    parts = []
    ttft = breakdown_markdown(ran, "ttft")
    first = (" With repeats: the first run's." if any(len(e.get("runs") or []) > 1 for e in ran)
             else "")
    if ttft:
        parts += ["## Where TTFT goes (mean and p95 of each part, ms)", "", ttft, "",
                  "Per request, the client's TTFT joined with the server trace by request id: "
                  "http = client TTFT − the router's TTFT (request send, HTTP, SSE write); "
                  "router = HTTP arrival to dispatch (tokenize, pick a worker); encode queue = "
                  "arrival at the encoding worker (EPD: an encode worker, else the one that "
                  "prefills) to encode start; encode = the vision encoder (EPD: of the encode "
                  "worker whose embeddings arrived last); embedding transfer (EPD) = writing "
                  "and reading the embedding frames; queue = arrival "
                  "at the worker to first scheduled; prefill = first scheduled to first token; "
                  "KV export (PD) happens before the first token leaves the prefill worker; "
                  "IPC hops = the router's remainder (ZeroMQ, event loop); other = what no "
                  "stage covers. Means add up to the mean TTFT; p95s do not add up." + first,
                  ""]
    gap = breakdown_markdown(ran, "handoff")
    if gap:
        parts += ["## PD hand-off (client gap token 1 → token 2; mean and p95 of each part, "
                  "ms)", "", gap, "",
                  "http = client gap − the router's gap; KV import runs at the start of the "
                  "decode worker's first step for the request; first decode step = the rest of "
                  "that step (batched with the running requests) to the second token; IPC hops "
                  "= the router's remainder (network and event-loop hops); other = what no "
                  "stage covers." + first, ""]
    return parts


def _run_section(e: dict) -> list[str]:
    """With repeats, the host load is the most disturbed run's."""
    parts = [f"## {e['name']}", ""]
    r = e["result"]
    runs = e.get("runs") or []
    median = f"median of {len(runs)} runs: " if len(runs) > 1 else ""
    parts.append(f"- {median}completed {_cell('{:d}', r['completed'])}, failed "
                 f"{_cell('{:d}', r['failed'])}, duration {r['duration']:.1f} s")
    if len(runs) > 1:
        parts.append("- per run (completed / failed, duration, goodput): " + "; ".join(
            f"{x['completed']} / {x['failed']}, {x['duration']:.1f} s, "
            f"{x['request_goodput'] or 0:.3f} req/s" for x in runs))
    parts += [f"- failed run: `{why}`" for why in e.get("failed_runs") or []]
    died = e.get("died")
    if died:
        parts += [f"- **{died['process']} exited with status {died['status']} during the run**; "
                  f"its other processes were stopped (log: `{died['log']}`), last lines:", "",
                  "```", died["log_tail"], "```", ""]
    errors = [x for x in r.get("errors", []) if x]
    if errors:
        parts.append(f"- first error: `{errors[0]}`")
    res = e.get("resources") or {}
    if res.get("workers"):
        parts.append("- workers: " + ", ".join(
            f"{w['worker_id']} ({w['role']}{', ' + w['weight_format'] if w.get('weight_format') else ''}) "
            f"cores {w['cores']}" for w in res["workers"]))
    srv = e.get("server") or {}
    if srv:
        parts.append(f"- server trace: {srv['num_records']} records, "
                     f"{srv['matched_client_requests']} joined with the client's by "
                     f"request id" + (f", {srv['malformed_lines']} malformed lines"
                                      if srv.get("malformed_lines") else ""))
    else:
        parts.append("- server trace: none")
    parts += role_switch_lines(e)
    if e.get("host_load"):
        parts.append(load_line(e["host_load"]))
    parts.append("")
    return parts


def role_switch_lines(e: dict) -> list[str]:
    """Decision times are s after the run's start (unix s without ``run_start_unix``)."""
    sw = e.get("role_switches") or {}
    if not sw:
        return []
    drain = ("" if sw.get("drain_ms_p50") is None else
             f", drain p50 {sw['drain_ms_p50']:,.0f} ms, max {sw['drain_ms_max']:,.0f} ms")
    lines = [f"- role switches: {sw['count']} done ({sw['requested']} asked){drain}"]
    origin = e.get("run_start_unix")
    decisions = sw.get("decisions") or []
    lines.append(f"- controller decisions: {len(decisions)}" + (":" if decisions else ""))
    for d in decisions:
        when = f"{d['at'] - origin:+.1f} s" if origin is not None else f"unix {d['at']:.1f}"
        lines.append(f"  - {when}: {d.get('action')} — {d.get('reason')}")
    return lines


def server_table_markdown(entries: list[dict]) -> str:
    """Mean and p95 of each server-trace field (ms, bytes or tokens per request); ''
    without a trace."""
    present = [f for f in FIELDS if any(f"mean_{f}" in (e.get("server") or {}) for e in entries)]
    if not present:
        return ""
    header = ["Field"] + [f"{e['name']} {s}" for e in entries for s in ("mean", "p95")]
    rows = []
    for f in present:
        cells = []
        for e in entries:
            for s in ("mean", "p95"):
                v = (e.get("server") or {}).get(f"{s}_{f}")
                cells.append("—" if v is None else f"{v:,.1f}")
        rows.append([f, *cells])
    return tables.markdown(header, rows)
