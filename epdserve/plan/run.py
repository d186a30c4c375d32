"""``epdserve plan``: predict which deployment meets the SLOs at the lowest cost (``search``), and
``calibrate``, ``validate`` and ``elastic-replay`` (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from epdserve.argtypes import Options, add_flags, config_from, flags_of, float_above, int_at_least, with_values
from epdserve.engine.config import EngineConfig
from epdserve.bench import metrics, production, production_formats, slo_map, workload
from epdserve.bench.compare import CONFIGS_FLAG
from epdserve.bench.datasets import with_images
from epdserve.bench.run import parse_goodput
from epdserve.model.loader import DEFAULT_VLM, ModelLoadError, resolve_model
from epdserve.plan import at_rate, calibrate, hardware, measured, replay, report, search, sim_elastic
from epdserve.plan.measured import calibration_path
from epdserve.plan.costmodel import NoStepModel, Platform, roofline_platform
from epdserve.plan.model_spec import BUILTIN, ModelSpec
from epdserve.plan.simulate import Deployment, EngineLimits, KVCapacityError
from epdserve.plan.validation import compare_deployment, compare_limits
from epdserve.serving import flags

ACTIONS = ("search", "calibrate", "validate", "elastic-replay")
REPLAYS = ("steady", "once")
# Arrival seeds per deployment: each after the first costs a fifth to a third (search's hint).
DEFAULT_SEEDS = 5
# SmolLM2-135M's context window: a step's budget without chunked prefill.
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
    for flag in flags_of(EngineConfig):  # the engine limits the simulated workers run with, as serve's
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
    add_flags(parser, flags.ElasticTimings)

def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
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


def _platform(args) -> Platform:
    if args.hardware.lower() == "cpu":
        vlm = args.model is not None and (args.model == DEFAULT_VLM or resolve_model(args.model).multimodal)
        platform = calibrate.platform_from(calibrate.load(calibration_path(args)), vlm=vlm)
    else:
        platform = roofline_platform(_model_spec(args.model), hardware.device(args.hardware, args.precision))
    if args.price_per_hour:
        platform.price_per_device_hour = args.price_per_hour
    return platform


# The synthetic trace planned for without --trace.
SYNTHETIC_DEFAULTS = {"input_len": (100, 400), "output_len": (32, 128), "num_requests": 300}


def _requests(args) -> list[workload.Request]:
    """``--trace``, or uniform lengths sent at once (the search re-times them with seeded
    Poisson arrivals); no prompt text is needed."""
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


# The options that fit a production trace (workload.add_production_arguments).
FIT_OPTIONS = ("start", "duration", "time_scale", "length_scale", "max_input_len", "max_output_len")


def _trace_requests(args) -> list[workload.Request]:
    """A Mooncake or Azure trace fitted by the production-trace options (stand-in prompts
    keep its shared blocks), or a saved bench trace as it is.

    Raises TraceError for a bad file or window, ValueError for options that do not apply."""
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
    """``--configs``, or every candidate of the device budget, with scheduler settings.

    Raises ValueError for ``--elastic-interval 0`` with ``--configs``, or as elastic_config."""
    if args.configs:
        timings = config_from(flags.ElasticTimings, args)
        window_s, interval_s, min_dwell_s = timings.window_s, timings.interval_s, timings.min_dwell_s
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
    """``--seeds`` seeds from ``--seed`` for a trace sent all at once; only ``--seed`` for a trace
    with arrivals of its own."""
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
    kind = "core" if args.hardware.lower() == "cpu" else "GPU"
    text, written = at_rate.plan(_deployments(args, platform, requests), platform, requests, slos, kind,
                                 args.slo_grid, Path(args.output), _workload(args, requests), args.devices)
    print(text)
    print(f"written: {', '.join(map(str, written))}")
    return 0


def _workload(args, requests: list[workload.Request]) -> str:
    source = f"trace {args.trace}" if args.trace else (
        f"input {args.input_len[0]}-{args.input_len[1]} tokens, output {args.output_len[0]}-{args.output_len[1]}, "
        f"seed {args.seed}")
    images = sum(len(r.images) for r in requests)
    return f"{len(requests)} requests, {source}" + (f", {images} images" if images else "")


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
        return {"search": run_search, "calibrate": measured.run_calibrate, "validate": measured.run_validate,
                "elastic-replay": measured.run_elastic_replay}[args.action](args)
    except (ValueError, ModelLoadError) as exc:
        print(f"epdserve plan: error: {exc}", file=sys.stderr)
        return 2
