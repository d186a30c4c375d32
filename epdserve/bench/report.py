"""Side-by-side comparison table of several configurations, as text and as markdown.

Input: the entries of ``compare.json`` (see :func:`epdserve.bench.compare.run_config`;
at least ``{"name", "result": <bench result dict>, "server": <trace summary or {}>}``);
entries with an ``error`` instead of a result (configurations that failed) get no column.
Rows are the metrics of :data:`ROWS`; columns are the configurations, then one ratio
column per configuration after the first (its value / the first's; "—" where undefined).
"""

from __future__ import annotations

from epdserve.bench.server_trace import FIELDS, sort_parts

# (label, where, key, format): where is "result" (bench result), "server" (trace summary),
# "per_core" or "resources" (see compare.run_config), or "" for the entry itself.
ROWS = [
    ("TTFT p50 (ms)", "result", "median_ttft_ms", "{:.1f}"),
    ("TTFT p95 (ms)", "result", "p95_ttft_ms", "{:.1f}"),
    ("TTFT p99 (ms)", "result", "p99_ttft_ms", "{:.1f}"),
    ("ITL p50 (ms)", "result", "median_itl_ms", "{:.1f}"),
    ("ITL p95 (ms)", "result", "p95_itl_ms", "{:.1f}"),
    ("ITL p99 (ms)", "result", "p99_itl_ms", "{:.1f}"),
    ("TPOT p50 (ms)", "result", "median_tpot_ms", "{:.1f}"),
    ("E2EL p50 (ms)", "result", "median_e2el_ms", "{:.1f}"),
    ("E2EL p95 (ms)", "result", "p95_e2el_ms", "{:.1f}"),
    ("Output tok/s", "result", "output_throughput", "{:.2f}"),
    ("Requests/s", "result", "request_throughput", "{:.3f}"),
    ("Goodput req/s", "result", "request_goodput", "{:.3f}"),
    ("ITL stalls (> 1 s)", "", "itl_stalls", "{:d}"),
    ("Cores", "resources", "num_cores", "{:d}"),
    ("Output tok/s per core", "per_core", "output_throughput", "{:.2f}"),
    ("Goodput req/s per core", "per_core", "request_goodput", "{:.3f}"),
    ("Failed requests", "result", "failed", "{:d}"),
    ("KV bytes/req", "server", "mean_kv_bytes", "{:,.0f}"),
    ("KV transfer ms/req", "server", "mean_kv_transfer_ms", "{:.2f}"),
    # over the requests with images (the trace's image keys; rows absent without images)
    ("Embedding bytes/req", "server", "mean_embedding_bytes", "{:,.0f}"),
    ("Embedding transfer ms/req", "server", "mean_embedding_transfer_ms", "{:.2f}"),
    ("Embedding bytes/image", "server", "mean_embedding_bytes_per_image", "{:,.0f}"),
    ("Encode ms/req", "server", "mean_encode_ms", "{:.1f}"),
]


def value(entry: dict, where: str, key: str):
    """The number for one table cell, or None when absent."""
    v = (entry.get(where) if where else entry) or {}
    v = v.get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def table(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (strings) of the comparison table. Rows whose value is absent in
    every configuration (e.g. goodput without SLOs) are left out."""
    entries = [e for e in entries if "result" in e]
    names = [e["name"] for e in entries]
    header = ["Metric", *names, *(f"{n}/{names[0]}" for n in names[1:])]
    rows = []
    for label, where, key, fmt in ROWS:
        values = [value(e, where, key) for e in entries]
        if all(v is None for v in values):
            continue
        cells = [fmt.format(v) if v is not None else "—" for v in values]
        base = values[0]
        for v in values[1:]:
            cells.append(f"{v / base:.2f}x" if v is not None and base else "—")
        rows.append([label, *cells])
    return header, rows


def text_table(entries: list[dict]) -> str:
    """The comparison table as aligned plain text."""
    header, rows = table(entries)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, rows)])


def markdown_table(entries: list[dict]) -> str:
    """The comparison table in GitHub markdown."""
    return _md_table(*table(entries))


def workload_lines(spec: dict, summary: dict) -> list[str]:
    """Markdown bullets describing the trace: how it was made (``spec``, from
    :func:`epdserve.bench.workload.build_from_args`) and what it holds (``summary``, from
    :func:`epdserve.bench.workload.describe`)."""
    fmt = lambda v: f"{v[0]}:{v[1]}" if isinstance(v, list) else str(v)  # noqa: E731
    params = ", ".join(f"{k}={fmt(v)}" for k, v in spec.items() if k != "source")
    lines = [f"- generator: {spec.get('source', '?')}" + (f" ({params})" if params else ""),
             f"- {summary['num_requests']} requests, sent over "
             f"{summary['duration_of_arrivals_s']:.1f} s"]
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
    return lines


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---", *["---:"] * (len(header) - 1)]) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def breakdown_markdown(entries: list[dict], which: str) -> str:
    """Mean and p95 (ms) of each part of TTFT (``which`` = "ttft") or of the PD hand-off
    gap ("handoff") per configuration, from each entry's ``breakdown`` (see
    :func:`epdserve.bench.server_trace.breakdown`), with a last row for the sum of the
    means (= the client's mean TTFT or gap); '' when no entry has one."""
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
    rows.append(["**sum (client)**", *total])
    return _md_table(header, rows)


def recommendation_markdown(rec: dict) -> str:
    """The "## Recommendation" section from :func:`epdserve.bench.recommend.recommend`."""
    head = (f"**Use {rec['choice']}**" + (" (a PD split)." if rec["split"] else
                                          " (no prefill/decode split).")
            if rec["choice"] else "**No recommendation.**")
    return "\n".join(["## Recommendation", "", head, "",
                      *[f"- {r}" for r in rec["reasons"]], "",
                      f"Rule: {rec['rule']} (epdserve/bench/recommend.py)."])


def sweep_markdown(entries: list[dict]) -> str:
    """The goodput-vs-rate results (one line per configuration), or how to get them."""
    have = [e for e in entries if e.get("sweep")]
    if not have:
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
        cores = (e.get("resources") or {}).get("num_cores")
        per_core = (f" ({sw['max_rate'] / cores:.3g} req/s per core)"
                    if cores and sw["max_rate"] is not None else "")
        lines.append(f"- {e['name']}: max rate with {sw['target_share']:.0%} of requests "
                     f"within the SLOs: {best}{per_core}; attainment by rate: {pts}")
    return "\n".join(lines)


def load_warnings(entries: list[dict]) -> list[str]:
    """``"NAME: warning"`` for each configuration during whose run other processes used a
    noticeable share of the cores (``host_load.warning``, see :mod:`epdserve.host`)."""
    return [f"{e['name']}: {e['host_load']['warning']}" for e in entries
            if (e.get("host_load") or {}).get("warning")]


def load_line(load: dict) -> str:
    """One markdown bullet on the load around a run, from an entry's ``host_load``."""
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
    """``compare.md``: the table, failures and outside-load warnings, the TTFT and hand-off
    breakdowns, the workload and the settings, each configuration's run (with the load on
    the host around it), goodput vs rate, and the recommendation (when given, from
    :func:`epdserve.bench.recommend.recommend`)."""
    ran = [e for e in entries if "result" in e]
    parts = ["# epdserve compare", "", markdown_table(ran), "",
             "Ratios are each configuration's value divided by the first's. Latencies are "
             "client-side (TTFT, ITL, TPOT, E2EL as vLLM's `bench serve` measures them, from "
             "the request's send); KV, encode and embedding "
             "rows come from the server trace (mean per request; encode and embedding rows "
             "over the requests with images, embedding bytes and transfer 0 unless EPD); "
             "cores are the CPU cores the workers were pinned to (from /health). Prefix "
             "caching is on unless a configuration's name ends in -noprefix.", ""]
    for e in entries:
        if "error" in e:
            parts += [f"**{e['name']} failed:** `{e['error']}`", ""]
    for line in load_warnings(ran):
        parts += [f"**Warning, outside load:** {line}.", ""]
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
    parts += ["## Goodput vs rate", "", sweep_markdown(ran), ""]
    if recommendation:
        parts += [recommendation_markdown(recommendation), ""]
    return "\n".join(parts)


def _breakdown_sections(ran: list[dict]) -> list[str]:
    """"Where TTFT goes" and the PD hand-off, each with what its parts mean (none without
    a server trace)."""
    parts = []
    ttft = breakdown_markdown(ran, "ttft")
    if ttft:
        parts += ["## Where TTFT goes", "", ttft, "",
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
                  "stage covers. Means add up to the mean TTFT; p95s do not add up.", ""]
    gap = breakdown_markdown(ran, "handoff")
    if gap:
        parts += ["## PD hand-off (client gap token 1 → token 2)", "", gap, "",
                  "KV import runs within the decode worker's first step; other = the rest "
                  "of that step and IPC hops.", ""]
    return parts


def _run_section(e: dict) -> list[str]:
    """One configuration's run: requests, first error, workers, server trace, host load."""
    parts = [f"## {e['name']}", ""]
    r = e["result"]
    parts.append(f"- completed {r['completed']}, failed {r['failed']}, "
                 f"duration {r['duration']:.1f} s")
    errors = [x for x in r.get("errors", []) if x]
    if errors:
        parts.append(f"- first error: `{errors[0]}`")
    res = e.get("resources") or {}
    if res.get("workers"):
        parts.append("- workers: " + ", ".join(
            f"{w['worker_id']} ({w['role']}) cores {w['cores']}" for w in res["workers"]))
    srv = e.get("server") or {}
    if srv:
        parts.append(f"- server trace: {srv['num_records']} records, "
                     f"{srv['matched_client_requests']} joined with the client's by "
                     f"request id" + (f", {srv['malformed_lines']} malformed lines"
                                      if srv.get("malformed_lines") else ""))
    else:
        parts.append("- server trace: none")
    if e.get("host_load"):
        parts.append(load_line(e["host_load"]))
    parts.append("")
    return parts


def server_table_markdown(entries: list[dict]) -> str:
    """Mean and p95 of each server-trace field (ms or bytes per request) per configuration,
    as markdown; '' when no configuration has a server trace."""
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
    return _md_table(header, rows)
