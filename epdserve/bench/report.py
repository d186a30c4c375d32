"""Side-by-side comparison table of several configurations, as text and as markdown.

Input: a list of entries ``{"name": str, "result": <bench result dict>, "server": <server
trace summary dict or {}>}``, as written to ``compare.json``. Rows are the metrics of
:data:`ROWS`; columns are the configurations, then one ratio column per configuration
after the first (its value / the first's; "—" where undefined).
"""

from __future__ import annotations

# (label, where, key, format): where is "result" (bench result) or "server" (trace summary).
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
    ("Failed requests", "result", "failed", "{:d}"),
    ("KV bytes/req", "server", "mean_kv_bytes", "{:,.0f}"),
    ("KV transfer ms/req", "server", "mean_kv_transfer_ms", "{:.2f}"),
]


def value(entry: dict, where: str, key: str):
    """The number for one table cell, or None when absent."""
    v = (entry.get(where) or {}).get(key)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def table(entries: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows (strings) of the comparison table. Rows whose value is absent in
    every configuration (e.g. goodput without SLOs) are left out."""
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
    header, rows = table(entries)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---", *["---:"] * (len(header) - 1)]) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def workload_lines(spec: dict, summary: dict) -> list[str]:
    """Markdown bullets describing the trace: how it was made (``spec``, from
    :func:`epdserve.bench.workload.build_from_args`) and what it holds (``summary``, from
    :func:`epdserve.bench.workload.describe`)."""
    fmt = lambda v: f"{v[0]}:{v[1]}" if isinstance(v, list) else str(v)  # noqa: E731
    params = ", ".join(f"{k}={fmt(v)}" for k, v in spec.items() if k != "source")
    lines = [f"- generator: {spec.get('source', '?')}" + (f" ({params})" if params else ""),
             f"- {summary['num_requests']} requests, sent over "
             f"{summary['duration_of_arrivals_s']:.1f} s"]
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


def markdown_report(entries: list[dict], workload_spec: dict, trace_summary: dict) -> str:
    """``compare.md``: the table, the workload, and each configuration's server summary."""
    parts = ["# epdserve compare", "", markdown_table(entries), "",
             "Ratios are each configuration's value divided by the first's. Latencies are "
             "client-side (TTFT, ITL, TPOT, E2EL as in DESIGN.md); KV rows come from the "
             "server trace (mean per request).", "", "## Workload", "",
             *workload_lines(workload_spec, trace_summary), ""]
    for e in entries:
        parts += [f"## {e['name']}", ""]
        r = e["result"]
        parts.append(f"- completed {r['completed']}, failed {r['failed']}, "
                     f"duration {r['duration']:.1f} s")
        errors = [x for x in r.get("errors", []) if x]
        if errors:
            parts.append(f"- first error: `{errors[0]}`")
        srv = e.get("server") or {}
        if srv:
            parts.append(f"- server trace: {srv['num_records']} records, "
                         f"{srv['matched_client_requests']} joined with the client's by "
                         f"request id" + (f", {srv['malformed_lines']} malformed lines"
                                          if srv.get("malformed_lines") else ""))
        else:
            parts.append("- server trace: none")
        parts.append("")
    stages = server_table_markdown(entries)
    if stages:
        parts += ["## Server-side stages (per request, from the server trace)", "", stages, ""]
    return "\n".join(parts)


def server_table_markdown(entries: list[dict]) -> str:
    """Mean and p95 of each server-trace field (ms or bytes per request) per configuration,
    as markdown; '' when no configuration has a server trace."""
    from epdserve.bench.server_trace import FIELDS

    present = [f for f in FIELDS if any(f"mean_{f}" in (e.get("server") or {}) for e in entries)]
    if not present:
        return ""
    header = ["Field"] + [f"{e['name']} {s}" for e in entries for s in ("mean", "p95")]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---", *["---:"] * (len(header) - 1)]) + "|"]
    for f in present:
        cells = []
        for e in entries:
            for s in ("mean", "p95"):
                v = (e.get("server") or {}).get(f"{s}_{f}")
                cells.append("—" if v is None else f"{v:,.1f}")
        lines.append("| " + " | ".join([f, *cells]) + " |")
    return "\n".join(lines)
