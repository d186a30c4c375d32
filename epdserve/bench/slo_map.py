"""Who wins at which SLOs: one measurement's saved per-request outcomes judged on a grid of TTFT
and longest-gap SLOs, each cell by the recommendation's rules and paired interval (TaiChi,
arXiv 2508.01989, draws this map from simulation); docs/comparing.md, "Who wins"."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from epdserve import extras
from epdserve.argtypes import Flag
from epdserve.bench import metrics, paired, rejudge, rules

AXES = ("ttft", "itl")  # rows, columns
FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # the default grid, times the user's SLO
MAX_VALUES = 8  # per axis
PNG = "slo_map.png"


def parse_axis(text: str) -> tuple[str, list[float]]:
    """``"ttft:500,1000,2000"`` -> ``("ttft", [500.0, 1000.0, 2000.0])``.

    Raises argparse.ArgumentTypeError naming the text: a key not in :data:`AXES`, a value not
    above 0, a repeat, none, or more than :data:`MAX_VALUES`."""
    key, sep, values = text.partition(":")
    shown = repr(text if len(text) <= 60 else text[:57] + "...")
    if key not in AXES or not sep:
        raise argparse.ArgumentTypeError(f"{shown}: expected KEY:MS,MS,... with KEY one of {', '.join(AXES)}")
    try:
        ms = [float(v) for v in values.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown}: not a comma list of milliseconds") from None
    if not all(math.isfinite(v) and v > 0 for v in ms):
        raise argparse.ArgumentTypeError(f"{shown}: an SLO must be a finite number above 0 ms")
    if len(set(ms)) != len(ms) or not 1 <= len(ms) <= MAX_VALUES:
        raise argparse.ArgumentTypeError(f"{shown}: 1 to {MAX_VALUES} distinct values")
    return key, sorted(ms)


SLO_GRID_FLAG = Flag(
    "--slo-grid", nargs="+", type=parse_axis, default=None, metavar="KEY:MS,MS",
    help="the SLOs the map of who wins is drawn over (slo_map.png, the report's table): ttft:MS,... and "
         "itl:MS,... (longest gap), up to 8 values each (default: a quarter to four times the --goodput or "
         "default SLO of each)")


def check_given(given: list[tuple[str, list[float]]] | None) -> str | None:
    """Why the axes cannot be used together (one given twice), or None."""
    keys = [k for k, _ in given or ()]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    return f"--slo-grid: {twice[0]} given twice" if twice else None


def grid(slos_ms: dict[str, float], given: list[tuple[str, list[float]]] | None = None) -> dict[str, list[float]]:
    """``given`` axes, else :data:`FACTORS` times the axis's SLO (or the default one)."""
    out = {key: [f * slos_ms.get(key, metrics.DEFAULT_SLOS_MS[key]) for f in FACTORS] for key in AXES}
    out.update(dict(given or ()))
    return out


def cell(entries: list[dict], slos_ms: dict[str, float]) -> dict:
    """``{"slos_ms", "winner", "verdict", "leader", "rival", "relative", "relative_ci",
    "attainment"}``; ``relative``: leader's goodput over the rival's minus 1, None when that is 0."""
    cands, _ = rules.candidates([rejudge.judge_entry(e, slos_ms) for e in entries])
    out = {"slos_ms": dict(slos_ms), "winner": None, "verdict": "none", "leader": None, "rival": None,
           "relative": None, "relative_ci": None,
           "attainment": {e["name"]: rules.figures(e)["slo_attainment"] for e in cands}}
    if not cands:
        return out
    basis = rules.basis_of(cands)
    out["winner"] = rules.choose(cands, basis)[0]["name"]
    if not any(e["result"]["request_goodput"] for e in cands):
        return out
    if rules.overloaded(cands):
        return {**out, "verdict": "overloaded"}
    leader, *others = sorted(cands, key=lambda e: -rules.score(e, basis))
    out.update(leader=leader["name"], verdict="only")
    if not others:
        return out
    c = rules.comparison(leader, others[0], basis)
    if c is None:
        return {**out, "rival": others[0]["name"], "verdict": "no interval"}
    return {**out, "rival": c.b, "verdict": c.verdict, "relative": c.relative, "relative_ci": c.relative_ci}


def slo_map(entries: list[dict], slos_ms: dict[str, float], axes: dict[str, list[float]]) -> dict:
    """``{"axes", "slos_ms", "cells": [[cell per column] per row]}``.
    Raises SavedRunError or ValueError as :func:`rejudge.check`."""
    rejudge.check(entries, {**slos_ms, **{k: v[0] for k, v in axes.items()}})
    rows, columns = (axes[k] for k in AXES)
    cells = [[cell(entries, {**slos_ms, AXES[0]: r, AXES[1]: c}) for c in columns] for r in rows]
    return {"axes": {k: list(axes[k]) for k in AXES}, "slos_ms": dict(slos_ms), "cells": cells}


def describe(c: dict) -> str:
    """"pd +16 % (CI +3.2..+29 %)", "tie: colocated", "colocated? (no difference shown)", ..."""
    if c["verdict"] == "better":
        ci, share = c["relative_ci"], c["attainment"]
        if ci is None:  # the rival served none within
            return f"{c['winner']} ({share[c['leader']]:.0%} vs {share[c['rival']]:.0%} within)"
        low = paired.percent(ci[0]).removesuffix(" %")
        return f"{c['winner']} {paired.percent(c['relative'])} (CI {low}..{paired.percent(ci[1])})"
    words = {"tie": "tie: {w}", "unresolved": "{w}? (no difference shown)", "overloaded": "overloaded: {w}",
             "only": "{w} (alone within)", "no interval": "{w} (no interval)"}
    return words.get(c["verdict"], "none within").format(w=c["winner"])


def _ms(v: float) -> str:
    return f"{v:,.0f} ms"


def markdown(m: dict) -> str:
    rows, columns = (m["axes"][k] for k in AXES)
    head = "| TTFT \\ longest gap | " + " | ".join(f"≤ {_ms(c)}" for c in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    for r, row in zip(rows, m["cells"]):
        lines.append(f"| ≤ {_ms(r)} | " + " | ".join(describe(c) for c in row) + " |")
    return "\n".join(lines)


def region(m: dict, slos_ms: dict[str, float]) -> str:
    """The cell at the user's SLOs (or nearest), then for each deployment shown better
    elsewhere the nearest cell where it is."""
    rows, columns = (m["axes"][k] for k in AXES)
    i = min(range(len(rows)), key=lambda k: abs(rows[k] - slos_ms.get(AXES[0], rows[k])))
    j = min(range(len(columns)), key=lambda k: abs(columns[k] - slos_ms.get(AXES[1], columns[k])))
    text = [f"at TTFT ≤ {_ms(rows[i])} and gaps ≤ {_ms(columns[j])}: {describe(m['cells'][i][j])}"]
    nearest = sorted(itertools.product(range(len(rows)), range(len(columns))),
                     key=lambda p: (abs(p[0] - i) + abs(p[1] - j), p))
    shown: set[str] = set()
    for a, b in nearest:
        c = m["cells"][a][b]
        if c["verdict"] == "better" and c["winner"] not in shown and (a, b) != (i, j):
            shown.add(c["winner"])
            text.append(f"{describe(c)} at TTFT ≤ {_ms(rows[a])} and gaps ≤ {_ms(columns[b])}")
    return "; ".join(text)


def plot(m: dict, path: str | Path) -> None:
    plt = extras.pyplot()
    names = sorted({c["winner"] for row in m["cells"] for c in row if c["winner"]})
    colours = plt.get_cmap("tab10")
    cells = [[(colours(names.index(c["winner"]) % 10) if c["winner"] else (0.9, 0.9, 0.9),
               0.85 if c["verdict"] == "better" else 0.3, describe(c).replace(" (", "\n(")) for c in row]
             for row in m["cells"]]
    draw(m["axes"], cells, "Who serves more within the SLOs (goodput per device; strong colour: shown better, "
                           "95 % CI)", path)


def draw(axes: dict[str, list[float]], cells: list[list[tuple]], title: str, path: str | Path) -> None:
    """``cells``: ``(colour, alpha, text)``, a row per TTFT SLO."""
    plt = extras.pyplot()
    rows, columns = (axes[k] for k in AXES)
    fig, ax = plt.subplots(figsize=(2.2 * len(columns) + 1.5, 0.9 * len(rows) + 1.5))
    for (a, row), b in itertools.product(enumerate(cells), range(len(columns))):
        colour, alpha, text = row[b]
        ax.add_patch(plt.Rectangle((b, a), 1, 1, color=colour, alpha=alpha))
        ax.text(b + 0.5, a + 0.5, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(columns))
    ax.set_ylim(0, len(rows))
    ax.set_xticks([b + 0.5 for b in range(len(columns))], [f"≤ {_ms(c)}" for c in columns])
    ax.set_yticks([a + 0.5 for a in range(len(rows))], [f"≤ {_ms(r)}" for r in rows])
    ax.set_xlabel("longest ITL gap SLO")
    ax.set_ylabel("TTFT SLO")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def for_outputs(entries: list[dict], slos_ms: dict[str, float], given: list | None,
                out_dir: Path) -> tuple[dict, str, list[Path]]:
    """(map or ``{"error": why}``, markdown section, PNGs drawn: none without matplotlib)."""
    title = "## Who wins at which SLOs\n\n"
    try:
        m = slo_map(entries, slos_ms, grid(slos_ms, given))
    except ValueError as exc:
        return {"error": str(exc)}, f"{title}No map: {exc}.\n", []
    section = (f"{title}The same requests judged on a grid of SLOs (the others as given), each cell by the "
               f"recommendation's rules and paired interval.\n\n{markdown(m)}\n")
    try:
        plot(m, Path(out_dir) / PNG)
    except extras.MissingExtra as exc:
        extras.warn_skipped(exc)
        return m, section, []
    return m, section + f"\n![SLO map]({PNG})\n", [Path(out_dir) / PNG]
