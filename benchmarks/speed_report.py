"""The report of ``benchmarks/speed.py``: the table per concurrency level with the
ratios against the goals, epdserve / vllm per level, the greedy-agreement check, and the
plot."""

from __future__ import annotations

from pathlib import Path

# epdserve's output tok/s goals: at least GOAL x the other engine's, at these levels.
GOALS = {"llama-server": (1.0, (1, 32)), "transformers-generate": (3.0, (32,))}
# epdserve / vllm per level: (label, result key, which way is better for epdserve).
VS_VLLM = (("output tok/s", "output_throughput", "higher"), ("TTFT p50", "median_ttft_ms", "lower"),
           ("ITL p50", "median_itl_ms", "lower"), ("ITL p99", "p99_itl_ms", "lower"))

def brief(result: dict) -> str:
    return (f"{result['completed']} ok, {result['failed']} failed, "
            f"{result['output_throughput']:.1f} out tok/s, TTFT p50 "
            f"{result['median_ttft_ms']:.0f} ms, ITL p50 {result['median_itl_ms']:.1f} ms")


def output_check(result: dict, asked: int) -> str:
    """"ok" when every request got ``asked`` output tokens (usage.completion_tokens, or
    chunks), else the lengths seen; failures show as "N failed"."""
    if result["failed"]:
        return f"{result['failed']} failed"
    lens = sorted(set(result["output_lens"]))
    return "ok" if lens == [asked] else "lens " + ",".join(map(str, lens))


def table(results: dict[str, dict[int, dict]], concurrency: list[int], asked: int) -> list[str]:
    """Per concurrency: one row per engine and epdserve's throughput ratios against its
    goals (:data:`GOALS`)."""
    lines = []
    for c in concurrency:
        if not any(c in per_c for per_c in results.values()):
            continue
        lines.append(f"\nconcurrency {c}")
        lines.append(f"  {'engine':<22}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p95':>10}"
                     f"{'ITL p50':>9}{'ITL p95':>9}{'prompt tok':>11}  output lens")
        for name, per_c in results.items():
            r = per_c.get(c)
            if r is None:
                continue
            prompt = r["total_input_tokens"] / r["completed"] if r["completed"] else 0
            lines.append(f"  {name:<22}{r['output_throughput']:>10.1f}{r['median_ttft_ms']:>10.0f}"
                         f"{r['p95_ttft_ms']:>10.0f}{r['median_itl_ms']:>9.1f}"
                         f"{r['p95_itl_ms']:>9.1f}{prompt:>11.0f}  {output_check(r, asked)}")
        ours = results.get("epdserve", {}).get(c)
        for other, (goal, levels) in GOALS.items():
            theirs = results.get(other, {}).get(c)
            if ours and theirs and theirs["output_throughput"] > 0:
                ratio = ours["output_throughput"] / theirs["output_throughput"]
                applies = c in levels
                verdict = (f"  (goal >= {goal:g}x: {'met' if ratio >= goal else 'MISSED'})"
                           if applies else "")
                lines.append(f"  epdserve / {other}: {ratio:.2f}x output tok/s{verdict}")
        ratios = vs_vllm(results, c)
        if ratios:
            lines.append("  epdserve / vllm: " + ", ".join(
                f"{label} {ratios[label]:.2f}x" if ratios[label] is not None else f"{label} -"
                for label, _, _ in VS_VLLM) + "  (tok/s: above 1 epdserve is faster; "
                "TTFT, ITL: below 1 epdserve is faster)")
    return lines


def vs_vllm(results: dict[str, dict[int, dict]], c: int) -> dict[str, float | None]:
    """epdserve's figure over vllm's at level ``c`` for each of :data:`VS_VLLM` (None where
    vllm's is 0); {} when either engine has no result there."""
    ours, theirs = results.get("epdserve", {}).get(c), results.get("vllm", {}).get(c)
    if not ours or not theirs:
        return {}
    return {label: ours[key] / theirs[key] if theirs.get(key) else None
            for label, key, _ in VS_VLLM}


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(results: dict[str, dict[int, dict]], level: int) -> dict:
    """The first prompt of level ``level``: epdserve's greedy text against the others'
    (``{"OTHER": {"exact", "common_prefix_chars", "chars"}}``)."""
    ours = results.get("epdserve", {}).get(level)
    if not ours or ours["errors"][0]:
        return {}
    text = ours["generated_texts"][0]
    out = {}
    for name, per_c in results.items():
        theirs = per_c.get(level)
        if name == "epdserve" or not theirs or theirs["errors"][0]:
            continue
        other = theirs["generated_texts"][0]
        out[name] = {"exact": other == text, "common_prefix_chars": common_prefix(text, other),
                     "chars": [len(text), len(other)]}
    return out


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    """Output tok/s and ITL p50 against concurrency, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = sorted({c for per_c in results.values() for c in per_c})
    for name, per_c in results.items():
        cs = sorted(per_c)
        ax1.plot(cs, [per_c[c]["output_throughput"] for c in cs], marker="o", label=name)
        ax2.plot(cs, [per_c[c]["median_itl_ms"] for c in cs], marker="o", label=name)
    for ax, title, unit in ((ax1, "Output throughput", "tokens/s"),
                            (ax2, "ITL p50", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
