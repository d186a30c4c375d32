"""Does the map of who wins at which SLOs repeat? The maps of several fresh ``epdserve compare``
runs of one workload (e.g. five ``make demo`` runs), cell by cell.

For every cell of the grid (the runs' maps must share it), the verdicts of all runs: how many
showed each deployment better, how many could not tell (a tie within the band, no difference
shown, overloaded). A cell *repeats* when no two runs show different winners better; it is
*settled* when every run showed the same winner better. The goal the demo is held to: every
cell outside the ties repeats.

    .venv/bin/python benchmarks/map_repeatability.py results/demo-maps/run1 results/demo-maps/run2 ... \\
        [--output DIR]

Prints a table (one row per TTFT SLO, one column per gap SLO, "pd 5/5", "colocated 3/5, 2
unresolved", "**colocated 2, pd 1**" for a cell that does not repeat) and the counts; with
``--output`` writes ``map_repeatability.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from epdserve import extras
from epdserve.bench import slo_map
from epdserve.model.kernels import cpu_model


def load_map(directory: Path) -> tuple[dict, str]:
    """compare.json's ``slo_map`` of one run directory, and a line naming its rounds the load
    check left out of the verdict and the map (other processes busy on the cores).

    Raises:
        SystemExit: no compare.json, or a run without a map (its reason).
    """
    doc = json.loads((directory / "compare.json").read_text())
    m = doc.get("slo_map") or {"error": "no slo_map (an older epdserve)"}
    if "cells" not in m:
        sys.exit(f"{directory}: {m['error']}")
    rounds = {e["name"]: len(e.get("per_run") or []) for e in doc["configs"]}
    flagged = [f"{e['name']} {len(e['flagged_runs'])}" for e in doc["configs"] if e.get("flagged_runs")]
    line = f"{directory}: rounds judged {rounds}" + (f"; left out (busy machine): {', '.join(flagged)}" if flagged
                                                     else "")
    return m, line


def tally(maps: list[dict]) -> dict:
    """Per cell, the winners shown better and the count of the rest, over ``maps`` of one grid:
    ``{"axes", "runs", "cells": [[{"better": {name: runs}, "not_shown": runs, "repeats",
    "settled"}]], "counts": {"cells", "repeat", "settled", "contradicting", "never_shown"}}``.

    Raises:
        SystemExit: maps of different grids.
    """
    axes = maps[0]["axes"]
    if any(m["axes"] != axes for m in maps):
        sys.exit("the runs' maps have different grids: compare them with the same --goodput and --slo-grid")
    rows = []
    for i in range(len(axes["ttft"])):
        row = []
        for j in range(len(axes["itl"])):
            cells = [m["cells"][i][j] for m in maps]
            better = Counter(c["winner"] for c in cells if c["verdict"] == "better")
            row.append({"better": dict(better), "not_shown": len(cells) - sum(better.values()),
                        "repeats": len(better) <= 1, "settled": len(better) == 1 and not
                        len(cells) - sum(better.values())})
        rows.append(row)
    flat = [c for row in rows for c in row]
    counts = {"cells": len(flat), "repeat": sum(c["repeats"] for c in flat),
              "settled": sum(c["settled"] for c in flat), "contradicting": sum(not c["repeats"] for c in flat),
              "shown_in_some": sum(bool(c["better"]) for c in flat), "never_shown": sum(not c["better"] for c in flat)}
    return {"axes": axes, "runs": len(maps), "cells": rows, "counts": counts}


def describe(c: dict, runs: int) -> str:
    if not c["better"]:
        return f"not shown ({runs}/{runs})"
    parts = [f"{name} {n}/{runs}" for name, n in sorted(c["better"].items())]
    text = ", ".join(parts) + (f", {c['not_shown']} not shown" if c["not_shown"] else "")
    return text if c["repeats"] else f"**{text}**"


def markdown(t: dict) -> str:
    rows, columns = t["axes"]["ttft"], t["axes"]["itl"]
    lines = ["| TTFT \\ longest gap | " + " | ".join(f"≤ {c:,.0f} ms" for c in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for r, row in zip(rows, t["cells"]):
        lines.append(f"| ≤ {r:,.0f} ms | " + " | ".join(describe(c, t["runs"]) for c in row) + " |")
    k = t["counts"]
    lines += ["", f"{t['runs']} runs, {k['cells']} cells: {k['repeat']} repeat (no two runs show different "
                  f"winners better), {k['contradicting']} contradict; {k['settled']} show the same winner better "
                  f"in every run; {k['shown_in_some']} show a winner better in at least one run, {k['never_shown']} "
                  f"in none (ties, no difference shown)."]
    return "\n".join(lines)


def plot(t: dict, path: Path) -> None:
    """Each cell coloured by the winner shown better most often, stronger the more runs."""
    plt = extras.pyplot()
    names = sorted({n for row in t["cells"] for c in row for n in c["better"]})
    colours = plt.get_cmap("tab10")
    cells = []
    for row in t["cells"]:
        tops = [max(c["better"].items(), key=lambda kv: kv[1], default=(None, 0)) for c in row]
        cells.append([(colours(names.index(name) % 10) if name else (0.9, 0.9, 0.9), 0.2 + 0.7 * n / t["runs"],
                       describe(c, t["runs"]).replace("**", "").replace(", ", "\n")) for (name, n), c in zip(tops, row)])
    slo_map.draw(t["axes"], cells, f"Runs (of {t['runs']}) that showed each winner better, per cell", path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="compare output directories of one workload")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    loaded = [load_map(d) for d in args.dirs]
    t = tally([m for m, _ in loaded])
    text = "\n".join(line for _, line in loaded) + "\n\n" + markdown(t)
    print(f"CPU: {cpu_model()}\n")
    print(text)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "map_repeatability.json").write_text(json.dumps({**t, "dirs": list(map(str, args.dirs))},
                                                                         indent=1))
        (args.output / "map_repeatability.md").write_text(text + "\n")
        plot(t, args.output / "map_repeatability.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
