"""A first start on a busy machine: what the block kernel / BLAS cut-over measures then, what
it keeps, and what keeping a busy answer would cost.

With ``EPDSERVE_CACHE`` pointed at a fresh temporary directory for the measured choices (the
machine's own are left alone; the directory is removed at the end), on ``--threads`` torch
threads (default: every core of the run):

1. one process per core of the run is busy on and off (``--busy-ms``, ``--idle-ms``) while the
   model loads with ``--weight-format`` (default ``q4_1+f32``); first one measurement alone
   (``cutover.measure``: what a start decided and kept when one measurement was all it took),
   then the model's own choice (``tuning.choose``: measured again while disturbed, kept
   marked disturbed);
2. the spinners stopped, the model loads again: the disturbed entry is measured again, on a
   quiet machine, and replaced;
3. a decode step's projections (every layer, as ``Linear`` dispatches them) at ``--batches``
   rows, timed with each of the three cut-overs (best of ``--reps`` each): what a busy
   answer costs each step of that size, had it been kept.

    .venv/bin/python benchmarks/busy_start.py [--weight-format q4_1+f32] [--batches 16 32 64 128 256]
        [--busy-ms 50] [--idle-ms 50] [--output DIR]

Prints the CPU model and flags; ``--output DIR`` writes ``busy_start.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import engine_limits  # benchmarks/
from epdserve.model import cutover, kernels, linear
from epdserve.model.llama import PROJECTIONS, LlamaModel
from epdserve.model.loader import resolve_model

# Busy for a random 0-2x ON_MS, idle for OFF_MS, for at most 10 minutes: load that comes and
# goes, as an install or a build beside the first start gives.
SPIN = ("import os, random, time\nos.sched_setaffinity(0, {%d})\nend = time.monotonic() + 600\n"
        "while time.monotonic() < end:\n"
        "    t = time.monotonic() + random.uniform(0, 2 * %g) / 1e3\n"
        "    while time.monotonic() < t: pass\n"
        "    time.sleep(%g / 1e3)\n")


def spinners(on_ms: float, off_ms: float) -> list[subprocess.Popen]:
    """One process per core of this process, busy for a random 0 to 2 ``on_ms`` then idle for
    ``off_ms``, over and over (each stops by itself after 10 minutes)."""
    return [subprocess.Popen([sys.executable, "-c", SPIN % (core, on_ms, off_ms)])
            for core in sorted(os.sched_getaffinity(0))]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def single_measurement(model: LlamaModel) -> dict:
    """One attempt of the cut-over's measurement on ``model``'s layers, as a start once kept
    it: its choice from the best times, from the medians, and the outside load."""
    layers = [[layer[k] for k in PROJECTIONS] for layer in model.layers]
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(max(cutover.ROWS), p.blocks.shape[1], generator=gen) for p in layers[0]]
    attempt = cutover.measure(lambda m: [p.on_kernel(x[:m]) for layer in layers for p, x in zip(layer, xs)],
                              lambda m: [p.on_blas(x[:m]) for layer in layers for p, x in zip(layer, xs)])
    return {"best": cutover.decide(attempt.best()), "median": cutover.decide(attempt.median()),
            "outside_share": attempt.outside_share}


def step_ms(model: LlamaModel, rows: int, kernel_rows: int, reps: int) -> float:
    """Best ms of every layer's projections at ``rows`` rows with the cut-over ``kernel_rows``."""
    lins = [layer[k] for layer in model.layers for k in PROJECTIONS]
    xs = {id(p): torch.randn(rows, p.blocks.shape[1]) for p in lins}
    saved = [p.kernel_rows for p in lins]
    try:
        for p in lins:
            p.kernel_rows = kernel_rows
        best = float("inf")
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            for p in lins:
                p(xs[id(p)])
            best = min(best, time.perf_counter() - t0)
    finally:
        for p, k in zip(lins, saved):
            p.kernel_rows = k
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weight-format", default="q4_1+f32", choices=[f for f in linear.WEIGHT_FORMATS if "q4_1" in f])
    p.add_argument("--threads", type=engine_limits.positive_int, default=engine_limits.default_threads())
    p.add_argument("--batches", type=engine_limits.positive_int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--reps", type=engine_limits.positive_int, default=5)
    p.add_argument("--busy-ms", type=float, default=50.0, metavar="MS",
                   help="each spinner is busy for a random 0 to 2x MS at a time (default %(default)g)")
    p.add_argument("--idle-ms", type=float, default=50.0, metavar="MS",
                   help="then idle for MS (default %(default)g; 0: busy throughout)")
    p.add_argument("--output", type=Path, default=None, metavar="DIR")
    args = p.parse_args(argv)
    if not kernels.available():
        raise SystemExit("busy_start: the C++ kernels did not build (they need AVX2 and FMA): no cut-over")
    if args.threads > engine_limits.default_threads():
        p.error(f"--threads {args.threads}: more than the {engine_limits.default_threads()} cores of this run")
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(None).path  # (converted, and the kernels built, in the user's cache)
    tmp = tempfile.mkdtemp(prefix="epdserve-busy-start-")
    os.environ["EPDSERVE_CACHE"] = tmp  # the measured choices only: the machine's own stay as they are
    try:
        return run(args, model_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, model_dir: Path) -> int:
    """Steps 1-3 of the module doc, with the choices kept in ``$EPDSERVE_CACHE``."""
    print(f"{engine_limits.cpu_model()}, {args.threads} threads, flags: {' '.join(engine_limits.speed_flags())}; "
          f"{args.weight_format}; choices kept in {os.environ['EPDSERVE_CACHE']} (removed at the end)", flush=True)
    busy = spinners(args.busy_ms, args.idle_ms)
    try:
        model = LlamaModel.load(model_dir, weight_format=args.weight_format, retune=True)
        disturbed = model.tuned["kernel_rows"]
        single = single_measurement(model)
    finally:
        stop(busy)
    busy_entry = json.loads(disturbed.path.read_text())
    print(f"busy: one measurement decides {single['best']} rows (its medians {single['median']}; others took "
          f"{single['outside_share']:.0%} of the cores); the model's choice: {disturbed.value} ({disturbed.source}; "
          f"kept marked disturbed: {busy_entry['disturbed']})", flush=True)
    quiet = LlamaModel.load(model_dir, weight_format=args.weight_format).tuned["kernel_rows"]
    quiet_entry = json.loads(quiet.path.read_text())
    print(f"quiet: {quiet.value} ({quiet.source}; kept marked disturbed: {quiet_entry['disturbed']})", flush=True)
    cuts = {"busy, one measurement": single["best"], "busy, kept disturbed": disturbed.value,
            "quiet, kept": quiet.value}
    steps = {m: {name: step_ms(model, m, rows, args.reps) for name, rows in cuts.items()} for m in args.batches}
    print(f"a decode step's projections, ms (best of {args.reps}) and x of the quiet choice's, with each cut-over:")
    print("  rows " + "".join(f"{f'{name} ({rows})':>28}" for name, rows in cuts.items()))
    for m, t in steps.items():
        base = t["quiet, kept"]
        print(f"  {m:>4} " + "".join(f"{f'{ms:.2f} ({ms / base:.2f}x)':>28}" for ms in t.values()))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        result = {"cpu": engine_limits.cpu_model(), "threads": args.threads, "weight_format": args.weight_format,
                  "busy_single": single, "busy_choice": disturbed.as_json(), "busy_entry": busy_entry,
                  "quiet_choice": quiet.as_json(), "quiet_entry": quiet_entry, "steps_ms": steps}
        (args.output / "busy_start.json").write_text(json.dumps(result, indent=1))
        print(f"written: {args.output / 'busy_start.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
