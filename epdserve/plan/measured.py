"""``epdserve plan calibrate``, ``validate`` and ``elastic-replay``: the planner against this
machine's measurements (docs/planner.md)."""

from __future__ import annotations

import hashlib
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from epdserve.bench import metrics
from epdserve.plan import at_rate, calibrate, elastic_replay, report
from epdserve.plan.costmodel import FEATURES, Platform
from epdserve.plan.options import PlanOptions
from epdserve.plan.serving_fit import (SERVING_PERCENTILE, compare_runs, contention_ratio, decode_gaps, fit_prefill,
                                       fit_serving, gap_percentiles, prefill_steps)
from epdserve.plan.validation import BANDED, VALIDATED, distinct_dirs, has_images, validate
from epdserve.serving.elastic.policy import PolicyConfig


def calibration_path(args: PlanOptions) -> Path:
    return Path(args.calibration) if args.calibration else calibrate.default_path(args.model)


def run_validate(args: PlanOptions) -> int:
    if not args.compare_dir:
        print("epdserve plan validate: error: --compare-dir DIR is required", file=sys.stderr)
        return 2
    path = calibration_path(args)
    cal = calibrate.load(path)
    compare_dirs = distinct_dirs(args.compare_dir)
    for d in compare_dirs:
        if not (d / "compare.json").is_file() or not (d / "trace.jsonl").is_file():
            print(f"epdserve plan validate: error: {d} has no compare.json and trace.jsonl", file=sys.stderr)
            return 2
    platform = calibrate.platform_from(cal, vlm=has_images(compare_dirs[0]))
    rows, predicted = validate(compare_dirs, platform)
    if not rows:
        print("epdserve plan validate: error: no configuration could be simulated", file=sys.stderr)
        return 1
    repeats = len(compare_dirs) > 1
    width = max(len("deployment"), *(len(row["name"]) for row in rows)) + 2
    print(f"{'deployment':<{width}}" + "".join(f"{k:>{58 if repeats else 46}}" for k in VALIDATED))
    for row in rows:
        print(f"{row['name']:<{width}}" + "".join(
            f"{row[k]['predicted']:>10.1f} [{row[k]['band'][0]:>7.1f}-{row[k]['band'][1]:>7.1f}] vs "
            f"{row[k]['measured']:>9.1f} ({report.fmt(row[k]['error'], '+.0%'):>6})"
            + (f" spread {report.fmt(row[k]['spread'], '.0%'):>4}" if repeats else "") for k in VALIDATED))
    if elastic := report.elastic_lines(rows):
        print("\n" + "\n".join(elastic).rstrip())
    if repeats:
        print(f"measured: the mean of {len(compare_dirs)} runs of the same trace; spread: (max - min) / mean "
              f"of those runs")
    u = platform.step_uncertainty
    held = sum(row[k]["in_band"] for row in rows for k in BANDED)
    print(f"[band]: predicted with step times x{1 - u:.2f} to x{1 + u:.2f} (the spread of the served runs "
          f"the slowdown was fitted on); it holds {held} of {len(rows) * len(BANDED)} measured latencies" if u else
          "[band]: none; fit the serving slowdown on 2 or more runs for one (`plan calibrate --from-compare`)")
    print(_serving_line(platform)
          + ("" if "serving" in cal else " (not fitted: run `epdserve plan calibrate --from-compare DIR...`)"))
    print("\n" + at_rate.side_by_side(compare_dirs, predicted, args.slo_grid, Path(args.output)))
    # One entry per workload (trace): validating it again replaces its entry.
    trace = hashlib.sha256((compare_dirs[0] / "trace.jsonl").read_bytes()).hexdigest()[:16]
    cal.setdefault("validations", {})[trace] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "compare_dirs": [str(d) for d in compare_dirs], "rows": rows,
        "max_abs_error": {k: max(abs(r[k]["error"] or 0) for r in rows) for k in VALIDATED},
        "max_spread": {k: max(r[k]["spread"] or 0 for r in rows) for k in VALIDATED},
        "step_uncertainty": u, "in_band": held, "values": len(rows) * len(BANDED)}
    calibrate.save(cal, path)
    print(f"stored in {path}")
    return 0


def run_fit_serving(args: PlanOptions) -> int:
    """``plan calibrate --from-compare``: fit the serving slowdowns into the calibration."""
    path = calibration_path(args)
    cal = calibrate.load(path)
    served = {}
    for d in distinct_dirs(args.from_compare):
        platform = calibrate.platform_from(cal, vlm=has_images(d))
        for name, run in compare_runs(d, platform).items():
            step = run.step(platform)
            served[f"{d}:{name}"] = (decode_gaps(run.seqs, step, run.contended),
                                     prefill_steps(run.seqs, step), run.sizes)
    slowdown, contended = fit_serving([gaps for gaps, _, _ in served.values()])
    prefill = fit_prefill([(steps, sizes) for _, steps, sizes in served.values()], slowdown)
    p = SERVING_PERCENTILE
    ratios, contention = {}, {}
    for run, (gaps, steps, sizes) in served.items():
        measured, model = gap_percentiles(gaps)
        line = f"{run}: {len(gaps)} decode steps"
        if not np.isnan(measured):
            ratios[run] = measured / model
            line += f", p{p} {measured:.1f} ms measured vs {model:.1f} ms by the step model (x{ratios[run]:.2f})"
        if (c := contention_ratio(gaps)) is not None:
            contention[run] = c
            line += f"; x{c:.2f} while every other core was busy ({sum(g[2] for g in gaps)} steps)"
        line += f"; {len(steps)} prefills on their own"
        print(line)
    cal["serving"] = {"decode_slowdown": slowdown, "contended_slowdown": contended,
                      "prefill_slowdown": {str(k): v for k, v in prefill.items()}, "percentile": p,
                      "ratios": ratios, "contention_ratios": contention,
                      "compare_dirs": [str(d) for d in args.from_compare],
                      "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    calibrate.save(cal, path)
    print(f"{_serving_line(calibrate.platform_from(cal))} (medians over the runs); written {path}")
    if not prefill:
        print("no prefill to fit on: these traces predate `cached_tokens` in the server trace, or every "
              "prefill was batched with another; prefill steps stay as calibrated")
    return 0


def _serving_line(platform: Platform) -> str:
    prefill = ", ".join(f"x{v:.2f} on {k}-core workers" for k, v in sorted(platform.prefill_slowdown.items()))
    return (f"served decode steps take x{platform.decode_slowdown:.2f} the calibrated time, "
            f"x{platform.contended_slowdown:.2f} more while every other core is busy; prefills "
            + (prefill or "as calibrated"))


def run_calibrate(args: PlanOptions) -> int:
    if args.from_compare:
        return run_fit_serving(args)
    cal = calibrate.calibrate(args.model, rounds=args.rounds)
    path = calibrate.save(cal, calibration_path(args))
    for model, steps in (("", cal["steps"]), (" (VLM's language model)", cal.get("vision", {}).get("steps", {}))):
        for size, fit in steps.items():
            coef = ", ".join(f"{c:.4g}" for c in fit["coef"])
            print(f"{size}-core worker{model}: ms = [{coef}] · [{', '.join(FEATURES)}]; "
                  f"mean |error| {fit['mean_abs_rel_error']:.1%} over {len(fit['samples'])} steps; "
                  f"the fits of its {fit['rounds']} rounds differ by {fit['round_spread']:.1%}")
    for ranks, fit in cal.get("tp_steps", {}).items():
        print(f"worker of {ranks} tensor-parallel ranks: ms = [{', '.join(f'{c:.4g}' for c in fit['coef'])}]; "
              f"mean |error| {fit['mean_abs_rel_error']:.1%} over {len(fit['samples'])} steps")
    for size, fit in cal.get("vision", {}).get("encode", {}).items():
        print(f"{size}-core worker: encode {fit['ms_per_tile']:.0f} ms per image tile "
              f"(calls of {', '.join(str(c['images']) for c in fit['samples'])} images)")
    print(f"KV hand-off: {cal['kv_link']['gbs']:.2f} GB/s + {cal['kv_link']['latency_ms']:.2f} ms; "
          f"written {path}")
    return 0


def run_elastic_replay(args: PlanOptions) -> int:
    """Returns 2 without the file."""
    if not args.elastic_trace:
        print("epdserve plan elastic-replay: error: --elastic-trace FILE is required", file=sys.stderr)
        return 2
    slos = dict(args.slo)
    timings = args.timings
    window_s, min_dwell_s = timings.window_s, timings.min_dwell_s
    config = PolicyConfig(slo_ttft_ms=slos.get("ttft", metrics.DEFAULT_SLOS_MS["ttft"]),
                          slo_tpot_ms=slos.get("tpot", metrics.DEFAULT_SLOS_MS["tpot"]),
                          window_s=window_s, min_dwell_s=min_dwell_s)
    samples, restarts, recorded = elastic_replay.read_trace(args.elastic_trace)
    if not samples:
        print(f"epdserve plan elastic-replay: error: {args.elastic_trace} has no elastic_sample lines "
              "(a trace of `serve --elastic`?)", file=sys.stderr)
        return 2
    changes = [d for d in elastic_replay.replay(samples, config, restarts) if d.roles is not None]
    for d in changes:
        print(f"+{d.t - samples[0].t:7.1f} s  {d.action}: {d.reason}")
    print(f"{len(changes)} role changes replayed over {samples[-1].t - samples[0].t:.0f} s of {len(samples)} "
          f"samples (the recording made {recorded}; {len(restarts)} changes it did not decide, by hand or "
          f"of workers, restarted the dwell as they did); ttft {config.slo_ttft_ms:g} ms, tpot {config.slo_tpot_ms:g} ms")
    return 0
