"""``epdserve plan``: predict which deployment meets the SLOs at the lowest cost.

* ``epdserve plan [search]`` — simulate every candidate deployment on a hardware profile
  (``--hardware H200``, roofline) or on this machine (``--hardware cpu``, calibrated) and
  recommend one; prints a table, writes ``plan.json`` / ``plan.md`` / ``goodput.png``.
* ``epdserve plan calibrate`` — measure this machine's engine and fit the cost model;
  ``--from-compare DIR...`` instead learns how much slower served decode steps are from
  ``epdserve compare`` outputs and stores it in the calibration.
* ``epdserve plan validate --compare-dir DIR`` — simulate the configurations of an
  ``epdserve compare`` run on its own trace, report the prediction errors and store them
  in the calibration, so later plans state them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from epdserve.argtypes import Options, float_above, int_at_least, with_values
from epdserve.bench import metrics, production, production_formats, slo_map, workload
from epdserve.bench.compare import CONFIGS_FLAG
from epdserve.bench.datasets import with_images
from epdserve.bench.run import parse_goodput
from epdserve.model.loader import DEFAULT_VLM, ModelLoadError, resolve_model
from epdserve.plan import at_rate, calibrate, elastic_replay, hardware, replay, report, search, sim_elastic
from epdserve.plan.costmodel import FEATURES, NoStepModel, Platform, roofline_platform
from epdserve.plan.model_spec import BUILTIN, ModelSpec
from epdserve.plan.simulate import Deployment, EngineLimits, KVCapacityError
from epdserve.serving.elastic.policy import PolicyConfig
from epdserve.plan.validation import (BANDED, VALIDATED, compare_deployment, compare_limits, distinct_dirs,
                                      has_images, validate)
from epdserve.plan.serving_fit import SERVING_PERCENTILE, compare_runs, contention_ratio, decode_gaps, fit_prefill, fit_serving, gap_percentiles, prefill_steps
from epdserve.serving import flags

ACTIONS = ("search", "calibrate", "validate", "elastic-replay")
REPLAYS = ("steady", "once")
# Arrival seeds per deployment (--seeds). A seed after the first costs a fifth to a third
# of it (search.evaluate's hint skips the low rates): 5 took 1.7-2.4 times as long as 1
# (docs/planner.md).
DEFAULT_SEEDS = 5
# The default model's context window (SmolLM2-135M's): a step's budget without chunked prefill.
DEFAULT_CONTEXT_WINDOW = 8192


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=ACTIONS, default="search",
                        help="search (default): recommend a deployment; calibrate: measure this "
                             "machine; validate: predicted vs measured for a compare run; elastic-replay: "
                             "the elastic controller's decisions on the signals an elastic server recorded "
                             "(--elastic-trace; SLOs from --slo ttft, tpot)")
    parser.add_argument("--hardware", default="cpu",
                        help=f"cpu (this machine, calibrated) or one of {', '.join(hardware.PROFILES)}")
    parser.add_argument("--model", default=None,
                        help=f"one of {', '.join(BUILTIN)}, a model path, or vlm (the default "
                             f"vision-language model) (default: the default model)")
    parser.add_argument("--precision", choices=hardware.PRECISIONS, default="bf16",
                        help="weights and KV precision on GPU profiles (default bf16)")
    parser.add_argument("--devices", type=workload.positive_int, default=2,
                        help="device budget: GPUs, or cores for --hardware cpu (default 2)")
    _add_workload_arguments(parser)
    parser.add_argument("--slo", nargs="+", type=parse_goodput, default=list(metrics.DEFAULT_SLOS_MS.items()),
                        metavar="KEY:MS",
                        help="SLOs in ms, as compare's --goodput: ttft, tpot, e2el, itl (the longest gap of a "
                             "request), itl_p99, e.g. ttft:300 tpot:10 itl:100 (default compare's: "
                             + " ".join(f"{k}:{v:g}" for k, v in metrics.DEFAULT_SLOS_MS.items()) + ")")
    parser.add_argument("--target", type=float, default=0.9,
                        help="capacity: share of requests that must meet every SLO (default 0.9)")
    parser.add_argument("--question", choices=at_rate.QUESTIONS, default="capacity",
                        help="capacity (default): the highest rate at which --target of the requests meet the "
                             "SLOs; goodput: requests/s within the SLOs at the --trace's own arrivals, judged "
                             "and mapped as `epdserve compare` judges a run (plan.md's map, slo_map.png)")
    slo_map.SLO_GRID_FLAG.add(parser)
    for flag in flags.WORKER_FLAGS:  # the engine limits the simulated workers run with, as serve's
        if flag.dest in ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"):
            flag.add(parser)
    parser.add_argument("--price-per-hour", type=float_above(0), default=None, help="USD per device-hour")
    CONFIGS_FLAG.add(parser)
    parser.add_argument("--replay", choices=REPLAYS, default="steady",
                        help="steady (default): at each rate, replay the trace back to back until the queue is "
                             "steady and measure the steady copies; once: the trace once, as "
                             "`epdserve compare --sweep-rates` sends it (optimistic for a short trace)")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="calibration file (default ~/.cache/epdserve/calibration/MODEL-cpu.json)")
    parser.add_argument("--compare-dir", nargs="+", default=None, metavar="DIR",
                        help="validate: `epdserve compare` outputs, several for repeats of one trace")
    parser.add_argument("--from-compare", nargs="+", default=None, metavar="DIR",
                        help="calibrate: fit the serving slowdown of prefill and decode steps to these `epdserve compare` "
                             "outputs (same engine as the calibration) instead of measuring the engine")
    parser.add_argument("--rounds", type=workload.positive_int, default=3, metavar="N",
                        help="calibrate: time every step N times and fit the medians (default 3)")
    parser.add_argument("--output", default="results/plan", metavar="DIR")
    parser.add_argument("--elastic-trace", default=None, metavar="FILE",
                        help="elastic-replay: the --trace-file of a `serve --elastic` router")
    flags.add_elastic_flags(parser)

def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace planned for: --trace (with the production-trace fitting options) or the
    synthetic lengths, images, seed."""
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="the trace to plan for, instead of --input-len etc.: a saved bench trace "
                             "(JSON lines), or a Mooncake (JSON lines) or Azure (CSV) production trace, "
                             "fitted by the production-trace options below (--num-requests N: its "
                             "first N requests)")
    workload.INPUT_LEN_FLAG.add(parser)
    workload.OUTPUT_LEN_FLAG.add(parser)
    parser.add_argument("--num-requests", type=workload.positive_int, default=None,
                        help="requests of the planned trace (default 300; not with --trace)")
    for flag in (*workload.IMAGE_FLAGS, workload.SEED_FLAG):
        flag.add(parser)
    parser.add_argument("--seeds", type=int_at_least(1), default=None, metavar="N",
                        help="arrival seeds: simulate each deployment on N arrival sequences of the same "
                             "requests, the Poisson arrivals of seeds --seed, --seed+1, ..., --seed+N-1, and "
                             "report each figure as the median over them with its band (min-max over the "
                             "seeds); a split is not picked over colocated when their goodput bands overlap "
                             f"(default {DEFAULT_SEEDS}; >= 1). A --trace with arrivals of its own has one "
                             "arrival sequence: it is simulated once, without a band")
    workload.add_production_arguments(parser)  # fit a Mooncake or Azure --trace


def _model_spec(name: str | None) -> ModelSpec:
    if name in BUILTIN:
        return BUILTIN[name]
    info = resolve_model(name)
    return ModelSpec.from_dir(info.name, info.path, info.multimodal)


def _calibration_path(args) -> Path:
    return Path(args.calibration) if args.calibration else calibrate.default_path(args.model)


def _platform(args) -> Platform:
    if args.hardware.lower() == "cpu":
        vlm = args.model is not None and (args.model == DEFAULT_VLM or resolve_model(args.model).multimodal)
        platform = calibrate.platform_from(calibrate.load(_calibration_path(args)), vlm=vlm)
    else:
        platform = roofline_platform(_model_spec(args.model), hardware.device(args.hardware, args.precision))
    if args.price_per_hour:
        platform.price_per_device_hour = args.price_per_hour
    return platform


# The synthetic trace planned for without --trace.
SYNTHETIC_DEFAULTS = {"input_len": (100, 400), "output_len": (32, 128), "num_requests": 300}


def _requests(args) -> list[workload.Request]:
    """The trace to plan for: ``--trace``, or uniform lengths (:data:`SYNTHETIC_DEFAULTS`
    resolved) sent at once (the search
    re-times them to each rate with seeded Poisson arrivals) with the images of
    ``--images-per-request`` as bench attaches them. No prompt text is needed."""
    if args.trace:
        return _trace_requests(args)
    fitting = [f"--{k.replace('_', '-')}" for k in FIT_OPTIONS if getattr(args, k) is not None]
    if fitting:
        raise ValueError(f"{', '.join(fitting)}: fit a Mooncake or Azure trace, given by --trace")
    rng = np.random.default_rng(args.seed)
    (a, b), (c, d) = args.input_len, args.output_len
    requests = [workload.Request(0.0, "", int(rng.integers(c, d + 1)), "chat", int(rng.integers(a, b + 1)))
                for _ in range(args.num_requests)]
    return with_images(requests, args.images_per_request, args.image_size, args.image_repeat_share, args.seed)


# The options of workload.add_production_arguments, which fit a production trace.
FIT_OPTIONS = ("start", "duration", "time_scale", "length_scale", "max_input_len", "max_output_len")


def _trace_requests(args) -> list[workload.Request]:
    """``--trace``: a Mooncake or Azure trace fitted by the production-trace options (the
    prompts are the planner's stand-ins, which keep the trace's shared blocks), or a saved
    bench trace, which those options and the synthetic ones do not apply to.

    Raises:
        TraceError: a bad trace file or window; ValueError: options that do not apply.
    """
    synthetic = [f"--{k.replace('_', '-')}" for k in ("input_len", "output_len") if getattr(args, k) is not None]
    if synthetic:
        raise ValueError(f"--trace excludes {', '.join(synthetic)}: the trace has its own requests")
    fmt = production_formats.detect_format(args.trace)
    if fmt is None:  # a saved bench trace: its requests as they are
        given = [f"--{k.replace('_', '-')}" for k in ("num_requests", *FIT_OPTIONS) if getattr(args, k) is not None]
        if given:
            raise ValueError(f"--trace {args.trace} is a saved bench trace: {', '.join(given)} do not apply to it")
        return workload.load_trace(args.trace)
    fit = workload.fit_from_args(args, args.num_requests)
    requests, report_ = production.replay_trace(production_formats.read_production(args.trace, fmt), fit, None,
                                                args.seed)
    print("\n".join(production.replay_lines(report_)), file=sys.stderr)
    return requests


def _deployments(args, platform: Platform, requests: list[workload.Request]) -> list[tuple[Deployment, EngineLimits]]:
    """The deployments to simulate, with their scheduler settings: ``--configs``, or every
    candidate of the device budget.

    Raises:
        ValueError: ``--elastic-interval 0`` (no controller) with ``--configs``; as
            :func:`~epdserve.plan.sim_elastic.elastic_config`.
    """
    if args.configs:
        window_s, interval_s, min_dwell_s = flags.elastic_settings(args)
        if interval_s == 0:  # serve's "no controller"; the simulation needs one that ticks
            raise ValueError("--elastic-interval 0: plan simulates the elastic controller, which needs an interval "
                             "> 0 (with 0, serve runs no controller: a static deployment)")
        elastic = sim_elastic.elastic_config(dict(args.slo), window_s, min_dwell_s, interval_s)
        return [(compare_deployment(name, args.devices, elastic), compare_limits(name)) for name in args.configs]
    # Without --max-num-batched-tokens a worker's step holds serve's default budget with
    # chunked prefill, else its context window: here the default model's.
    budget = args.max_num_batched_tokens or (None if args.enable_chunked_prefill else DEFAULT_CONTEXT_WINDOW)
    limits = EngineLimits(args.max_num_seqs, budget, args.enable_chunked_prefill)
    return [(d, limits) for d in search.candidates(platform, args.devices, images=any(r.images for r in requests))]


def arrival_seeds(args, requests: list[workload.Request]) -> list[int]:
    """The arrival seeds to simulate (:func:`search.evaluate_seeds`): ``--seeds`` of them
    from ``--seed`` on, for a trace sent all at once (seeded Poisson arrivals at each
    rate); only ``--seed`` for a trace with arrivals of its own (the same sequence for
    every seed)."""
    n = args.seeds or DEFAULT_SEEDS
    return [args.seed + i for i in range(n)] if replay.sent_at_once(requests) else [args.seed]


def run_search(args) -> int:
    platform = _platform(args)
    if not args.trace:  # the synthetic trace's lengths and size, resolved once (also for the report)
        args = with_values(args, **{k: v for k, v in SYNTHETIC_DEFAULTS.items() if getattr(args, k) is None})
    requests, slos = _requests(args), dict(args.slo)
    seeds = arrival_seeds(args, requests)
    if args.seeds and len(seeds) < args.seeds:  # asked for, and not the default
        print(f"--seeds {args.seeds}: the trace has arrivals of its own, one sequence: each deployment is "
              f"simulated on it once, without a band over seeds", file=sys.stderr)
    if args.question == "goodput":
        return run_goodput(args, platform, requests, slos)
    steady = args.replay == "steady"
    rows, curves, skipped = [], {}, {}
    for dep, limits in tqdm(_deployments(args, platform, requests), desc="plan", unit="deployment"):
        try:
            cands = search.evaluate_seeds(dep, platform, requests, slos, args.target, limits, seeds, steady)
        except (KVCapacityError, NoStepModel) as exc:
            skipped[dep.name] = str(exc)
            continue
        row = search.seed_row(cands, platform, seeds)
        rows.append(row)
        median = cands[seeds.index(row["median_seed"])]
        curves[dep.name] = median.points
        if band := platform.band():  # step times ± their uncertainty, on the median seed's arrivals
            rates = [row["max_goodput_rps"]] + [
                search.evaluate(dep, p, requests, slos, args.target, limits, steady=steady, seed=row["median_seed"],
                                hint=median.max_rate).max_rate or 0.0 for p in band]
            row["goodput_band_rps"] = [min(rates), max(rates)]
    rows.sort(key=lambda r: -r["goodput_per_device"])
    pick, why = search.recommend(rows) if rows else (None, "every deployment was skipped (see the table)")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"platform": platform.name, "devices": args.devices, "workload": _workload(args, requests),
           "slos_ms": slos, "target": args.target, "replay": args.replay,
           "seeds": seeds, "seeds_requested": args.seeds or DEFAULT_SEEDS,
           "arrivals": "poisson" if replay.sent_at_once(requests) else "trace", "seed_band": "min-max",
           "step_uncertainty": platform.step_uncertainty, "candidates": rows, "skipped": skipped,
           "recommendation": pick and pick["name"], "reason": why,
           "split_vs_colocated": search.split_vs_colocated(rows), "validations": platform.error}
    (out / "plan.json").write_text(json.dumps(doc, indent=1))
    text = report.markdown(doc)
    (out / "plan.md").write_text(text)
    drawn = report.plot(curves, args.target, out / "goodput.png")
    print(text)
    print(f"written: {out / 'plan.md'}, {out / 'plan.json'}" + (f", {out / 'goodput.png'}" if drawn else ""))
    return 0


def run_goodput(args, platform: Platform, requests: list[workload.Request], slos: dict[str, float]) -> int:
    """``--question goodput`` (:func:`epdserve.plan.at_rate.plan`)."""
    kind = "core" if args.hardware.lower() == "cpu" else "GPU"
    text, written = at_rate.plan(_deployments(args, platform, requests), platform, requests, slos, kind,
                                 args.slo_grid, Path(args.output), _workload(args, requests), args.devices)
    print(text)
    print(f"written: {', '.join(map(str, written))}")
    return 0


def _workload(args, requests: list[workload.Request]) -> str:
    """What was planned for, in words."""
    source = f"trace {args.trace}" if args.trace else (
        f"input {args.input_len[0]}-{args.input_len[1]} tokens, output {args.output_len[0]}-{args.output_len[1]}, "
        f"seed {args.seed}")
    images = sum(len(r.images) for r in requests)
    return f"{len(requests)} requests, {source}" + (f", {images} images" if images else "")


def run_validate(args) -> int:
    if not args.compare_dir:
        print("epdserve plan validate: error: --compare-dir DIR is required", file=sys.stderr)
        return 2
    path = _calibration_path(args)
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


def run_fit_serving(args) -> int:
    """``plan calibrate --from-compare DIR...``: fit ``serving.decode_slowdown``,
    ``serving.contended_slowdown`` and ``serving.prefill_slowdown`` into the calibration
    (see :func:`fit_serving` and :func:`fit_prefill`) and print each
    run's ratios."""
    path = _calibration_path(args)
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
    """What the fitted serving slowdown of ``platform`` is, in words."""
    prefill = ", ".join(f"x{v:.2f} on {k}-core workers" for k, v in sorted(platform.prefill_slowdown.items()))
    return (f"served decode steps take x{platform.decode_slowdown:.2f} the calibrated time, "
            f"x{platform.contended_slowdown:.2f} more while every other core is busy; prefills "
            + (prefill or "as calibrated"))


def run_calibrate(args) -> int:
    if args.from_compare:
        return run_fit_serving(args)
    cal = calibrate.calibrate(args.model, rounds=args.rounds)
    path = calibrate.save(cal, _calibration_path(args))
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


def run_elastic_replay(args) -> int:
    """Print the decisions that change roles of the policy replayed on ``--elastic-trace``'s
    samples (``+T s: action: reason``), and how many the recording made. Returns 2 without
    the file."""
    if not args.elastic_trace:
        print("epdserve plan elastic-replay: error: --elastic-trace FILE is required", file=sys.stderr)
        return 2
    slos = dict(args.slo)
    window_s, _, min_dwell_s = flags.elastic_settings(args)
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


def run(args: Options) -> int:
    if not 0 < args.target <= 1:
        print(f"epdserve plan: error: --target {args.target}: must be in (0, 1]", file=sys.stderr)
        return 2
    if why := slo_map.check_given(args.slo_grid):
        print(f"epdserve plan: error: {why}", file=sys.stderr)
        return 2
    if args.question == "goodput" and args.action != "search":
        print(f"epdserve plan: error: --question goodput is for `epdserve plan` (search), not {args.action}",
              file=sys.stderr)
        return 2
    if args.slo_grid and not (args.action == "validate" or args.question == "goodput"):
        print("epdserve plan: error: --slo-grid draws the map of --question goodput (and of validate)",
              file=sys.stderr)
        return 2
    for option, action in (("compare_dir", "validate"), ("from_compare", "calibrate")):
        if getattr(args, option) and args.action != action:
            print(f"epdserve plan: error: --{option.replace('_', '-')} is for `epdserve plan {action}`",
                  file=sys.stderr)
            return 2
    try:
        return {"search": run_search, "calibrate": run_calibrate, "validate": run_validate,
                "elastic-replay": run_elastic_replay}[args.action](args)
    except (ValueError, ModelLoadError) as exc:
        print(f"epdserve plan: error: {exc}", file=sys.stderr)
        return 2
