"""PNG plots of a comparison from compare.json entries' per-request arrays (s), so results read
back from disk plot too; matplotlib (the ``plots`` extra) is imported only to draw."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from epdserve import extras
from epdserve.bench.metrics import STALL_MS  # also the default ITL SLO
from epdserve.bench.server_trace import PART_ORDER


def __getattr__(name: str):
    """``plots.plt``: ``matplotlib.pyplot``, imported at first use."""
    if name == "plt":
        return extras.pyplot()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ok(result: dict) -> list[int]:
    return [i for i, e in enumerate(result["errors"]) if not e]


def ttfts_ms(result: dict) -> np.ndarray:
    return np.array([result["ttfts"][i] * 1000.0 for i in _ok(result)])


def itls_ms(result: dict) -> np.ndarray:
    return np.array([g * 1000.0 for i in _ok(result) for g in result["itls"][i]])


def itl_stalls(result: dict) -> int:
    """ITL gaps longer than :data:`STALL_MS` over completed requests."""
    return int((itls_ms(result) > STALL_MS).sum())


def itl_times(result: dict) -> tuple[np.ndarray, np.ndarray]:
    """(s since start when each gap ended, gap ms); chunk k arrives at start_offset + ttft +
    the first k gaps."""
    times, gaps = [], []
    for i in _ok(result):
        t = result["start_offsets"][i] + result["ttfts"][i]
        for g in result["itls"][i]:
            t += g
            times.append(t)
            gaps.append(g * 1000.0)
    return np.array(times), np.array(gaps)


def _cdf(ax, values: np.ndarray, label: str) -> None:
    if values.size:
        x = np.sort(values)
        y = np.arange(1, x.size + 1) / x.size
        ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post", label=f"{label} (n={x.size})")


def plot_cdf(entries: list[dict], which: str, path: str | Path) -> None:
    """``which``: "ttft" or "itl" (pooled)."""
    plt = extras.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    get = ttfts_ms if which == "ttft" else itls_ms
    for e in entries:
        _cdf(ax, get(e["result"]), e["name"])
    ax.set_xlabel(f"{which.upper()} (ms)")
    ax.set_ylabel("fraction of " + ("requests" if which == "ttft" else "gaps"))
    ax.set_title(f"{which.upper()} CDF")
    if which == "itl":
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_itl_over_time(entries: list[dict], long_offsets_s: list[float],
                       path: str | Path, phase_starts_s: list[float] = ()) -> None:
    """Long-prompt sends dashed, phase starts dash-dotted, the stall threshold dotted; an
    elastic entry adds a panel of its workers' roles on the same time axis."""
    plt = extras.pyplot()
    elastic = [e for e in entries if e.get("roles_timeline") and e.get("run_start_unix") is not None]
    lanes = [len(e["roles_timeline"]) for e in elastic]
    heights = [0.9 + 0.35 * n for n in lanes]  # inches: a lane per worker, the legend's row
    fig, axes = plt.subplots(1 + len(elastic), 1, sharex=True, squeeze=False,
                             figsize=(10, 4.5 + sum(heights)), height_ratios=[4.5, *heights])
    ax = axes[0, 0]
    for e, marker in zip(entries, "o^sDv<>" * 4):
        t, g = itl_times(e["result"])
        ax.scatter(t, g, s=5, alpha=0.5, marker=marker, label=e["name"])
    for k, x in enumerate(long_offsets_s):
        ax.axvline(x, color="red", linestyle="--", linewidth=1,
                   label="long prompt sent" if k == 0 else None)
    for k, x in enumerate(phase_starts_s):
        ax.axvline(x, color="black", linestyle="-.", linewidth=1, label="phase starts" if k == 0 else None)
        ax.annotate(f"phase {k + 1}", (x, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8)
    ax.axhline(STALL_MS, color="grey", linestyle=":", linewidth=1,
               label=f"stall (> {STALL_MS / 1000:g} s)")
    ax.set_ylabel("ITL (ms)")
    ax.set_yscale("log")
    ax.set_title("Inter-token latency over time")
    ax.grid(True, alpha=0.3)
    ax.legend(markerscale=3)
    x_lo, x_hi = ax.get_xlim()  # the ITL's span: role intervals outside it are cut
    for e, role_ax in zip(elastic, axes[1:, 0]):
        plot_roles(role_ax, e["roles_timeline"], e["run_start_unix"], e["name"])
    if elastic:
        ax.set_xlim(x_lo, x_hi)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# A draining interval takes its new role's colour, hatched.
ROLE_COLOURS = {"colocated": "tab:green", "prefill": "tab:orange", "decode": "tab:blue"}


def plot_roles(ax, timeline: dict[str, list], origin_unix: float, name: str) -> None:
    """A lane per worker, at s since ``origin_unix`` (the ITL plot's 0), hatched while draining."""
    plt = extras.pyplot()
    workers = sorted(timeline, reverse=True)  # the first worker on top
    for y, worker in enumerate(workers):
        for start, end, role, state in timeline[worker]:
            ax.broken_barh([(start - origin_unix, end - start)], (y - 0.4, 0.8),
                           facecolors=ROLE_COLOURS.get(role, "lightgrey"), edgecolor="white",
                           hatch="///" if state == "draining" else None, linewidth=0.5)
    ax.set_yticks(range(len(workers)), workers, fontsize=8)
    ax.set_ylim(-0.6, len(workers) + 0.5)  # a row above the lanes for the legend
    ax.set_ylabel(f"{name}\nroles", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ROLE_COLOURS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="grey", hatch="///"))
    ax.legend(handles, [*ROLE_COLOURS, "draining"], fontsize=7, loc="upper right", ncol=4)


def plot_stages(entries: list[dict], path: str | Path) -> None:
    """Mean TTFT parts (ms) per configuration, beside the PD hand-off gap's where present."""
    plt = extras.pyplot()
    panels = [(w, t, [e for e in entries if (e.get("breakdown") or {}).get(w)])
              for w, t in (("ttft", "TTFT"), ("handoff", "PD hand-off gap (token 1 → 2)"))]
    panels = [p for p in panels if p[2]] or [("ttft", "TTFT", [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 + 3 * len(panels), 4.8), squeeze=False)
    # One colour per part across both panels (decode queue is the same stage in both).
    known = dict.fromkeys(p for order in PART_ORDER.values() for p in order if p != "other")
    palette = itertools.cycle(plt.get_cmap("tab20").colors)
    colours = {p: next(palette) for p in known}
    colours["other"] = "lightgrey"
    used: dict[str, str] = {}
    for ax, (which, title, have) in zip(axes[0], panels):
        for x, e in enumerate(have):
            b = e["breakdown"][which]
            bottom = 0.0
            for part in b["parts"]:
                v = b["mean"][part]
                if part not in colours:  # a stage this module does not know yet
                    colours[part] = next(palette)
                colour = used[part] = colours[part]
                ax.bar(x, v, bottom=bottom, color=colour, width=0.6)
                bottom += v
            ax.text(x, bottom, f"{bottom:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.08)  # room for the totals above the bars
        ax.set_xticks(range(len(have)), [e["name"] for e in have], rotation=15)
        ax.set_ylabel("mean per request (ms)")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    order = [p for p in colours if p in used and p != "other"] + ["other"] * ("other" in used)
    handles = [plt.Rectangle((0, 0), 1, 1, color=used[p]) for p in order][::-1]
    fig.legend(handles, order[::-1], loc="upper right", fontsize=8)  # top of the stack first
    fig.suptitle("Where the time goes (client TTFT joined with the server trace)")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_goodput_vs_rate(entries: list[dict], path: str | Path) -> None:
    plt = extras.pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    target = None
    for e in entries:
        sw = e.get("sweep")
        if not sw:
            continue
        target = sw["target_share"]
        rates = [p["rate"] for p in sw["points"]]
        ax.plot(rates, [p["request_goodput"] for p in sw["points"]], "o-", label=e["name"])
        ax2.plot(rates, [p["slo_attainment"] for p in sw["points"]], "o-", label=e["name"])
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("goodput (req/s within the SLOs)")
    ax.set_title("Goodput vs rate")
    ax2.set_xlabel("offered request rate (req/s)")
    ax2.set_ylabel("share of requests within the SLOs")
    ax2.set_ylim(0, 1.05)
    if target is not None:
        ax2.axhline(target, color="red", linestyle="--", linewidth=1, label="target")
    ax2.set_title("SLO attainment vs rate")
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(entries: list[dict], long_offsets_s: list[float], out_dir: str | Path,
             phase_starts_s: list[float] = ()) -> list[Path]:
    """Paths written; none (after one warning line) without matplotlib."""
    try:
        extras.pyplot()
    except extras.MissingExtra as exc:
        extras.warn_skipped(exc)
        return []
    out_dir = Path(out_dir)
    paths = [out_dir / "ttft_cdf.png", out_dir / "itl_cdf.png", out_dir / "itl_over_time.png",
             out_dir / "stages.png"]
    plot_cdf(entries, "ttft", paths[0])
    plot_cdf(entries, "itl", paths[1])
    plot_itl_over_time(entries, long_offsets_s, paths[2], phase_starts_s)
    plot_stages(entries, paths[3])
    if any(e.get("sweep") for e in entries):
        paths.append(out_dir / "goodput_vs_rate.png")
        plot_goodput_vs_rate(entries, paths[-1])
    return paths
