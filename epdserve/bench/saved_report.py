"""``epdserve report DIR [DIR ...]``: a saved comparison judged again, without running it.

Reads the ``compare.json`` and ``trace.jsonl`` that ``epdserve compare`` wrote in each DIR
(several DIRs: runs of the same trace, their rounds pooled per deployment name as more
repeats), judges every request again against ``--goodput`` (default: the SLOs the run was
judged by, :mod:`epdserve.bench.rejudge`) and writes the comparison table, the verdict and
the map of who wins at which SLOs (``--slo-grid``, :mod:`epdserve.bench.slo_map`) under
``--output`` (default ``DIR/report``): ``compare.json``, ``compare.md`` and the plots, as
compare writes them. With the SLOs the run had, the verdict is compare's.

Refused, with one line naming the file or value and exit status 2, before anything is
written: a directory without ``compare.json`` or its trace, one saved by an older layout
(:data:`epdserve.bench.compare.VERSION`), directories of different traces, an entry without
the per-request values an SLO needs, an SLO of 0 ms or below, a bad ``--slo-grid``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from epdserve.argtypes import Options
from epdserve.bench import compare, recommend, rejudge, slo_map, workload
from epdserve.bench.run import parse_goodput


class Refused(ValueError):
    """A saved directory that cannot be reported on (the message names it and why)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="epdserve compare --output directories of one trace")
    parser.add_argument("--goodput", nargs="+", type=parse_goodput, default=None, metavar="KEY:MS",
                        help="the SLOs to judge by, as compare's --goodput (default: the ones the run was judged by)")
    slo_map.SLO_GRID_FLAG.add(parser)
    parser.add_argument("--output", default=None, metavar="DIR",
                        help="where the report goes (default: the first DIR's report/)")


def load(directory: Path) -> dict:
    """One saved comparison: compare.json, with ``requests`` (its trace).

    Raises:
        Refused: no compare.json or trace, unreadable, or of another layout.
    """
    path = directory / "compare.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise Refused(f"{path}: not a saved comparison ({exc})") from None
    if saved.get("version") != compare.VERSION:
        raise Refused(f"{path}: saved by an older epdserve (layout {saved.get('version', 1)}; this one reads "
                      f"{compare.VERSION}, with every SLO's per-request values): run compare again")
    try:
        saved["requests"] = workload.load_trace(directory / "trace.jsonl")
    except workload.TraceError as exc:
        raise Refused(str(exc)) from None
    return saved


def pooled(saved: list[dict], dirs: list[Path]) -> list[dict]:
    """The entries of several saved comparisons of one trace, each deployment's runs
    (``per_run``, ``runs``) pooled in the order given; an entry that failed in one directory
    but ran in another keeps the runs.

    Raises:
        Refused: two directories of different traces.
    """
    first = saved[0]["trace"]["sha256"]
    for s, d in zip(saved[1:], dirs[1:]):
        if s["trace"]["sha256"] != first:
            raise Refused(f"{d}: another trace than {dirs[0]}'s (trace.jsonl sha256 {s['trace']['sha256'][:12]} "
                          f"vs {first[:12]}): pool only runs of one trace")
    entries: dict[str, dict] = {}
    for s in saved:
        for e in s["configs"]:
            kept = entries.get(e["name"])
            if kept is None or "result" not in kept:
                entries[e["name"]] = dict(e)
            elif "result" in e:
                entries[e["name"]] = {**kept, "per_run": kept.get("per_run", []) + e.get("per_run", []),
                                      "runs": kept.get("runs", []) + e.get("runs", []), "spread": kept.get("spread") or {}}
    return list(entries.values())


def run(args: Options) -> int:
    dirs = [Path(d) for d in args.dirs]
    try:
        saved = [load(d) for d in dirs]
        entries = pooled(saved, dirs)
        was = recommend.recommend(entries)
        slos = dict(args.goodput) if args.goodput else was["slos_ms"]
        judged = rejudge.judge(entries, slos, default=not args.goodput and was["slos_default"])
    except ValueError as exc:  # Refused, rejudge.SavedRunError, a bad SLO
        print(f"epdserve report: error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.output) if args.output else dirs[0] / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    first = saved[0]
    spec = {k: v for k, v in first["trace"].items() if k not in ("file", "num_requests", "sha256")}
    stopped = first["recommendation"].get("stopped", "") if len(dirs) == 1 else ""
    rec = {**recommend.recommend(judged), "stopped": stopped, "judged_again_from": [str(d) for d in dirs]}
    sampling = {**first.get("sampling", {}), "slo_grid": args.slo_grid}
    files = compare.write_outputs(judged, first["requests"], spec, out_dir, sampling, rec)
    compare.print_summary(judged, rec, out_dir, files)
    return 0
