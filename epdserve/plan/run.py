"""``epdserve plan``: predict which deployment meets the SLOs at the lowest cost (``search``), and
``calibrate``, ``validate`` and ``elastic-replay`` (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from epdserve.argtypes import add_flags
from epdserve.bench import production, production_formats, slo_map, workload
from epdserve.bench.datasets import with_images
from epdserve.model.loader import DEFAULT_VLM, ModelLoadError, resolve_model
from epdserve.plan import at_rate, calibrate, hardware, measured, replay, report, search, sim_elastic
from epdserve.plan.measured import calibration_path
from epdserve.plan.costmodel import NoStepModel, Platform, roofline_platform
from epdserve.plan.model_spec import BUILTIN, ModelSpec
from epdserve.plan.options import DEFAULT_SEEDS, PlanOptions, PlanWorkload
from epdserve.plan.simulate import Deployment, EngineLimits, KVCapacityError
from epdserve.plan.validation import compare_deployment, compare_limits

# SmolLM2-135M's context window: a step's budget without chunked prefill.
DEFAULT_CONTEXT_WINDOW = 8192

OPTIONS = PlanOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, PlanOptions)


def _model_spec(name: str | None) -> ModelSpec:
    if name in BUILTIN:
        return BUILTIN[name]
    info = resolve_model(name)
    return ModelSpec.from_dir(info.name, info.path, info.multimodal)


def _platform(args: PlanOptions) -> Platform:
    if args.hardware.lower() == "cpu":
        vlm = args.model is not None and (args.model == DEFAULT_VLM or resolve_model(args.model).multimodal)
        platform = calibrate.platform_from(calibrate.load(calibration_path(args)), vlm=vlm)
    else:
        platform = roofline_platform(_model_spec(args.model), hardware.device(args.hardware, args.precision))
    if args.price_per_hour:
        platform.price_per_device_hour = args.price_per_hour
    return platform


def _requests(w: PlanWorkload) -> list[workload.Request]:
    """``--trace``, or uniform lengths sent at once (the search re-times them with seeded
    Poisson arrivals); no prompt text is needed."""
    if w.trace:
        return _trace_requests(w)
    fitting = w.production.given()
    if fitting:
        raise ValueError(f"{', '.join(fitting)}: fit a Mooncake or Azure trace, given by --trace")
    rng = np.random.default_rng(w.seed)
    (a, b), (c, d) = w.input_len, w.output_len
    requests = [workload.Request(0.0, "", int(rng.integers(c, d + 1)), "chat", int(rng.integers(a, b + 1)))
                for _ in range(w.num_requests)]
    return with_images(requests, w.images_per_request, w.image_size, w.image_repeat_share, w.seed)


def _trace_requests(w: PlanWorkload) -> list[workload.Request]:
    """A Mooncake or Azure trace fitted by the production-trace options (stand-in prompts
    keep its shared blocks), or a saved bench trace as it is.

    Raises TraceError for a bad file or window, ValueError for options that do not apply."""
    synthetic = [flag for flag, value in (("--input-len", w.input_len), ("--output-len", w.output_len))
                 if value is not None]
    if synthetic:
        raise ValueError(f"--trace excludes {', '.join(synthetic)}: the trace has its own requests")
    fmt = production_formats.detect_format(w.trace)
    if fmt is None:  # a saved bench trace: its requests as they are
        given = (["--num-requests"] if w.num_requests is not None else []) + w.production.given()
        if given:
            raise ValueError(f"--trace {w.trace} is a saved bench trace: {', '.join(given)} do not apply to it")
        return workload.load_trace(w.trace)
    fit = w.production.fit(w.num_requests)
    requests, report_ = production.replay_trace(production_formats.read_production(w.trace, fmt), fit, None, w.seed)
    print("\n".join(production.replay_lines(report_)), file=sys.stderr)
    return requests


def _deployments(args: PlanOptions, platform: Platform,
                 requests: list[workload.Request]) -> list[tuple[Deployment, EngineLimits]]:
    """``--configs``, or every candidate of the device budget, with scheduler settings.

    Raises ValueError for ``--elastic-interval 0`` with ``--configs``, or as elastic_config."""
    if args.configs:
        timings = args.timings
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


def arrival_seeds(w: PlanWorkload, requests: list[workload.Request]) -> list[int]:
    """``--seeds`` seeds from ``--seed`` for a trace sent all at once; only ``--seed`` for a trace
    with arrivals of its own."""
    n = w.seeds or DEFAULT_SEEDS
    return [w.seed + i for i in range(n)] if replay.sent_at_once(requests) else [w.seed]


def run_search(args: PlanOptions) -> int:
    platform = _platform(args)
    if not args.workload.trace:  # the synthetic trace's lengths and size, resolved once (also for the report)
        args = replace(args, workload=args.workload.synthetic())
    w = args.workload
    requests, slos = _requests(w), dict(args.slo)
    seeds = arrival_seeds(w, requests)
    if w.seeds and len(seeds) < w.seeds:  # asked for, and not the default
        print(f"--seeds {w.seeds}: the trace has arrivals of its own, one sequence: each deployment is "
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
           "seeds": seeds, "seeds_requested": w.seeds or DEFAULT_SEEDS,
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


def run_goodput(args: PlanOptions, platform: Platform, requests: list[workload.Request], slos: dict[str, float]) -> int:
    kind = "core" if args.hardware.lower() == "cpu" else "GPU"
    text, written = at_rate.plan(_deployments(args, platform, requests), platform, requests, slos, kind,
                                 args.slo_grid, Path(args.output), _workload(args, requests), args.devices)
    print(text)
    print(f"written: {', '.join(map(str, written))}")
    return 0


def _workload(args: PlanOptions, requests: list[workload.Request]) -> str:
    w = args.workload
    source = f"trace {w.trace}" if w.trace else (
        f"input {w.input_len[0]}-{w.input_len[1]} tokens, output {w.output_len[0]}-{w.output_len[1]}, "
        f"seed {w.seed}")
    images = sum(len(r.images) for r in requests)
    return f"{len(requests)} requests, {source}" + (f", {images} images" if images else "")


def run(args: PlanOptions) -> int:
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
    for option, given, action in (("--compare-dir", args.compare_dir, "validate"),
                                  ("--from-compare", args.from_compare, "calibrate")):
        if given and args.action != action:
            print(f"epdserve plan: error: {option} is for `epdserve plan {action}`", file=sys.stderr)
            return 2
    try:
        return {"search": run_search, "calibrate": measured.run_calibrate, "validate": measured.run_validate,
                "elastic-replay": measured.run_elastic_replay}[args.action](args)
    except (ValueError, ModelLoadError) as exc:
        print(f"epdserve plan: error: {exc}", file=sys.stderr)
        return 2
