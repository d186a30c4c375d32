"""How close `epdserve plan`'s predicted goodput comes to the goodput `epdserve compare`
measures, per deployment, on one workload.

1. ``epdserve compare --configs C --goodput SLOS --sweep-rates LO:HI`` with the workload
   options given (any of compare's: ``--workload``, ``--num-prompts``, ``--input-len``,
   ``--request-rate``, ``--dataset-path``, ...): each deployment is served on this
   machine's cores and its highest rate within the SLOs found by bisection, the trace
   re-timed to each rate (``--compare-dir DIR`` reads a finished run instead);
2. ``epdserve plan --hardware cpu --trace DIR/trace.jsonl --configs C --slo SLOS`` on the
   same trace, SLOs, target and seed, twice: ``--replay steady`` (what ``plan`` reports:
   the trace back to back until the queue is steady) and ``--replay once`` (the trace
   once per rate, as the sweep sends it: the same test as the measurement, so the
   difference between the two predictions is what a short trace's missing steady state
   is worth, and the error of ``once`` is the simulator's own);
3. prints, per deployment, the predicted goodput (req/s) against the measured sweep's
   highest passing rate, with the bracket the bisection left ([passing, failing] req/s)
   and the ratio predicted / measured; then, per rate the sweep served, the measured SLO
   attainment with its 95 % interval against the simulated attainment of the same
   arrivals (:func:`epdserve.plan.validation.sweep_attainment`): a check that does not
   hinge on where a flat attainment curve crosses the target; writes
   ``plan_vs_sweep.json`` and ``plan_vs_sweep.png`` under ``--output``.

The goal: predicted within 15 % of measured (ratio 0.85-1.15) on at least two
workloads. The measured sweep replays the trace once per rate, so use a trace long enough
to reach its steady state (a few hundred requests); then ``steady`` and ``once`` agree and
both compare with the sweep. Run on a quiet machine: other load slows the served runs and
not the simulation. The calibration (``epdserve plan calibrate``, and ``--from-compare`` on
runs of this machine) must exist first.

    .venv/bin/python benchmarks/plan_vs_sweep.py --configs colocated,colocated-2,pd \\
        --goodput ttft:2000 tpot:150 --sweep-rates 0.25:4 --sweep-iters 4 \\
        --output results/plan-vs-sweep/synthetic \\
        --workload synthetic --num-prompts 200 --input-len 100:300 --output-len 50:100 --request-rate 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from epdserve.bench.compare import parse_configs
from epdserve.bench.run import parse_goodput, parse_rates, parse_share
from epdserve.bench.workload import load_trace
from epdserve.plan import calibrate
from epdserve.plan.validation import entry_cores, sweep_attainment

EPDSERVE = [sys.executable, "-m", "epdserve"]
GOAL = 0.15  # |predicted / measured - 1| within this: the goal
REPLAYS = ("steady", "once")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest: the workload options passed to compare."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Other options are compare's workload options, passed to it.")
    p.add_argument("--configs", type=parse_configs, default=None, help="deployments, e.g. colocated,pd")
    p.add_argument("--goodput", nargs="+", type=parse_goodput, default=None, metavar="KEY:MS",
                   help="the SLOs, as compare's --goodput (e.g. ttft:2000 tpot:150)")
    p.add_argument("--sweep-rates", type=parse_rates, default=(0.25, 4.0), metavar="LO:HI",
                   help="compare's bisection range, req/s (default 0.25:4)")
    p.add_argument("--sweep-iters", type=int, default=4, metavar="N", help="compare's bisection steps (default 4)")
    p.add_argument("--goodput-target", type=parse_share, default=0.9, metavar="F",
                   help="share of requests within the SLOs (default 0.9), for both")
    p.add_argument("--seed", type=int, default=None, help="workload and arrival seed, for both (default 0)")
    p.add_argument("--devices", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores compare's deployments run on (default: this process's, as compare uses)")
    p.add_argument("--calibration", default=None, metavar="FILE", help="plan's calibration (default: its own)")
    p.add_argument("--compare-dir", default=None, metavar="DIR",
                   help="a finished `epdserve compare --sweep-rates` run to read instead of running one "
                        "(its configurations, SLOs, target and seed: not to be given)")
    p.add_argument("--output", default="results/plan-vs-sweep", metavar="DIR")
    args, rest = p.parse_known_args(argv)
    given = [o for o, v in (("--configs", args.configs), ("--goodput", args.goodput), ("--seed", args.seed))
             if v is not None]
    if args.compare_dir and (given or rest):
        p.error(f"--compare-dir reads a finished run, with its own settings and workload: drop "
                f"{' '.join(given + rest)}")
    if not args.compare_dir and not (args.configs and args.goodput):
        p.error("--configs and --goodput are required (or --compare-dir DIR)")
    return args, rest


def from_compare_run(args: argparse.Namespace, compare: dict) -> None:
    """Take the configurations, SLOs, target and seed of a finished compare run into ``args``."""
    args.configs = [e["name"] for e in compare["configs"]]
    args.goodput = list((compare["sampling"].get("goodput") or {}).items())
    args.goodput_target = next((e["sweep"]["target_share"] for e in compare["configs"] if e.get("sweep")),
                               args.goodput_target)
    args.seed = compare["trace"].get("seed", 0)


def run(cmd: list[str]) -> None:
    """Run ``cmd`` with its output shown; exit with its status if it fails."""
    print("$ " + " ".join(cmd), flush=True)
    status = subprocess.run(cmd).returncode
    if status:
        sys.exit(f"plan_vs_sweep: `{' '.join(cmd[2:4])}` failed with status {status}")


def slo_args(goodput: list[tuple[str, float]]) -> list[str]:
    return [f"{k}:{v:g}" for k, v in goodput]


def run_compare(args: argparse.Namespace, workload_args: list[str], out: Path) -> None:
    run([*EPDSERVE, "compare", "--configs", ",".join(args.configs), "--goodput", *slo_args(args.goodput),
         "--sweep-rates", "{:g}:{:g}".format(*args.sweep_rates), "--sweep-iters", str(args.sweep_iters),
         "--goodput-target", str(args.goodput_target), "--seed", str(args.seed), "--output", str(out),
         "--repeats", "1", *workload_args])


def run_plan(args: argparse.Namespace, trace: Path, replay: str, out: Path) -> None:
    images = any(r.images for r in load_trace(trace))
    run([*EPDSERVE, "plan", "--hardware", "cpu", "--devices", str(args.devices), "--trace", str(trace),
         "--configs", ",".join(args.configs), "--slo", *slo_args(args.goodput), "--target", str(args.goodput_target),
         "--seed", str(args.seed), "--replay", replay, "--output", str(out)]
        + (["--model", "vlm"] if images else []) + (["--calibration", args.calibration] if args.calibration else []))


def join(compare: dict, plans: dict[str, dict]) -> list[dict]:
    """One row per deployment of the compare run: ``measured_rps`` (the sweep's highest
    passing rate, None when none passed or the deployment failed), ``bracket`` ([passing,
    failing] req/s; failing None when HI passed too: the goodput is HI or more, and no
    ratio is given), and per replay of ``plans`` (plan.json documents by replay)
    ``predicted_rps``, ``unbounded`` (plan met the SLOs at every rate it tried: the
    prediction is a lower bound) and ``ratio`` = predicted / measured."""
    rows = []
    for entry in compare["configs"]:
        sweep = entry.get("sweep") or {}
        bracket = sweep.get("bracket")
        measured = sweep.get("max_rate") if bracket and bracket[1] is not None else None
        row = {"name": entry["name"], "measured_rps": sweep.get("max_rate"), "bracket": bracket,
               "error": entry.get("error")}
        for replay, plan in plans.items():
            cand = next((c for c in plan["candidates"] if c["name"] == entry["name"]), {})
            predicted = cand.get("max_goodput_rps")
            row[replay] = {"predicted_rps": predicted, "unbounded": cand.get("unbounded", False),
                           "band_rps": cand.get("goodput_band_rps"),
                           "ratio": predicted / measured if predicted and measured else None}
        rows.append(row)
    return rows


def attainment(args: argparse.Namespace, compare: dict, trace: Path) -> dict[str, list[dict]]:
    """Per deployment that ran a sweep: :func:`sweep_attainment` with plan's calibration
    (``--calibration`` or its default)."""
    requests = load_trace(trace)
    path = args.calibration or calibrate.default_path(None)
    platform = calibrate.platform_from(calibrate.load(path), vlm=any(r.images for r in requests))
    return {e["name"]: sweep_attainment(e, entry_cores(e), platform, requests, dict(args.goodput), args.seed)
            for e in compare["configs"] if (e.get("sweep") or {}).get("points")}


def attainment_table(by_name: dict[str, list[dict]]) -> str:
    """:func:`attainment`'s rows as a markdown table."""
    lines = ["| deployment | rate req/s | measured in SLOs [95 % interval] | simulated | simulated − measured |",
             "|---|---|---|---|---|"]
    for name, rows in by_name.items():
        lines += [f"| {name} | {r['rate']:.3g} | {r['measured']:.1%} [{r['interval'][0]:.1%} – {r['interval'][1]:.1%}] "
                  f"| {r['simulated']:.1%} | {100 * r['error']:+.1f} pt{'' if r['in_interval'] else ' (outside)'} |"
                  for r in rows]
    inside = sum(r["in_interval"] for rows in by_name.values() for r in rows)
    total = sum(len(rows) for rows in by_name.values())
    return "\n".join(lines + ["", f"Simulated attainment inside the measured 95 % interval at {inside} of {total} "
                                   "swept rates."])


def _fmt(v, spec: str = ".3g") -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| deployment | measured req/s [bracket] | plan steady req/s | ratio | plan once req/s | ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if not r["bracket"]:
            measured = r["error"] or "—"
        elif r["bracket"][1] is None:
            measured = f"≥ {_fmt(r['measured_rps'])} (HI passed)"
        else:
            measured = "{} [{} – {}]".format(*map(_fmt, [r["measured_rps"], *r["bracket"]]))
        cells = [f"{'≥ ' if r[k]['unbounded'] else ''}{_fmt(r[k]['predicted_rps'])} | {_fmt(r[k]['ratio'], '.2f')}"
                 for k in REPLAYS if k in r]
        lines.append(f"| {r['name']} | {measured} | " + " | ".join(cells) + " |")
    within = [r["name"] for r in rows if r.get("steady", {}).get("ratio") and abs(r["steady"]["ratio"] - 1) <= GOAL]
    lines += ["", f"Within {GOAL:.0%} (plan steady vs measured): {', '.join(within) or 'none'} "
                  f"of {len(rows)} deployments."]
    if any(r["bracket"] and r["bracket"][1] is None for r in rows):
        lines.append("≥ (HI passed): the deployment met the SLOs at the sweep's highest rate; rerun with a higher "
                     "--sweep-rates HI for a ratio.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Bars per deployment: the measured goodput (its bisection bracket as the error bar)
    and plan's two predictions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x, width = range(len(rows)), 0.27
    measured = [r["measured_rps"] or 0.0 for r in rows]
    spans = [[0.0, 0.0] if not r["bracket"] or r["bracket"][1] is None or r["measured_rps"] is None
             else [0.0, r["bracket"][1] - r["measured_rps"]] for r in rows]
    ax.bar([i - width for i in x], measured, width, yerr=list(zip(*spans)) if rows else None, capsize=3,
           label="measured (compare sweep; bar to the first failing rate)")
    for j, replay in enumerate(REPLAYS):
        ax.bar([i + j * width for i in x], [r[replay]["predicted_rps"] or 0.0 for r in rows], width,
               label=f"plan --replay {replay}")
    ax.set_xticks(list(x), [r["name"] for r in rows])
    ax.set_ylabel("goodput (req/s)")
    values = [v for r in rows for v in [r["measured_rps"]] + [r[k]["predicted_rps"] for k in REPLAYS] if v]
    if values and max(values) > 10 * min(values):  # a short trace's `once` can be far off: keep the rest readable
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args, workload_args = parse_args(argv)
    out = Path(args.output)
    compare_dir = Path(args.compare_dir) if args.compare_dir else out / "compare"
    if not args.compare_dir:
        args.seed = 0 if args.seed is None else args.seed
        run_compare(args, workload_args, compare_dir)
    trace = compare_dir / "trace.jsonl"
    if not (compare_dir / "compare.json").is_file() or not trace.is_file():
        sys.exit(f"plan_vs_sweep: {compare_dir} has no compare.json and trace.jsonl")
    compare = json.loads((compare_dir / "compare.json").read_text())
    if args.compare_dir:
        from_compare_run(args, compare)
    plans = {}
    for replay in REPLAYS:
        run_plan(args, trace, replay, out / f"plan-{replay}")
        plans[replay] = json.loads((out / f"plan-{replay}" / "plan.json").read_text())
    rows = join(compare, plans)
    swept = attainment(args, compare, trace)
    doc = {"compare_dir": str(compare_dir), "configs": args.configs, "slos_ms": dict(args.goodput),
           "target": args.goodput_target, "num_requests": compare["trace"]["num_requests"], "goal": GOAL,
           "rows": rows, "attainment": swept}
    (out / "plan_vs_sweep.json").write_text(json.dumps(doc, indent=1))
    plot(rows, out / "plan_vs_sweep.png")
    print(table(rows))
    print()
    print(attainment_table(swept))
    print(f"written: {out / 'plan_vs_sweep.json'}, {out / 'plan_vs_sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
