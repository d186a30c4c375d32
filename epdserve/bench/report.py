"""Side-by-side comparison table of several configurations, as text and as markdown.

Input: a list of entries ``{"name": str, "result": <bench result dict>, "server": <server
trace summary dict or {}>}``, as written to ``compare.json``. Rows are the metrics of
:data:`ROWS`; columns are the configurations, then one ratio column per configuration
after the first (its value / the first's; "—" where undefined).
"""

from __future__ import annotations

import json

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


def markdown_report(entries: list[dict], workload_spec: dict, trace_summary: dict) -> str:
    """``compare.md``: the table, the workload, and each configuration's server summary."""
    parts = ["# epdserve compare", "", markdown_table(entries), "",
             "Ratios are each configuration's value divided by the first's. Latencies are "
             "client-side (TTFT, ITL, TPOT, E2EL as in DESIGN.md); KV rows come from the "
             "server trace (mean per request).", "", "## Workload", "",
             "```json", json.dumps({"generator": workload_spec, "trace": trace_summary},
                                   indent=2), "```", ""]
    for e in entries:
        parts += [f"## {e['name']}", ""]
        r = e["result"]
        parts.append(f"- completed {r['completed']}, failed {r['failed']}, "
                     f"duration {r['duration']:.1f} s")
        errors = [x for x in r.get("errors", []) if x]
        if errors:
            parts.append(f"- first error: `{errors[0]}`")
        if e.get("server"):
            parts.append("- server trace: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in e["server"].items()))
        else:
            parts.append("- server trace: none")
        parts.append("")
    return "\n".join(parts)
