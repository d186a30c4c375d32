"""``epdserve compare``: run one trace against each deployment, in interleaved rounds, and write
compare.json, compare.md and plots under ``--output`` (docs/comparing.md).
Exit status: 0 all ran, 1 one failed to start, answer or stay up, 2 bad input or a deployment
the host cannot hold, 130 on Ctrl-C."""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path

from epdserve import host
from epdserve.argtypes import Flag, Options, config_from, float_above, with_values
from epdserve.bench import client, plots, recommend, repeats, report, rounds, server_metrics, slo_map, sweep, workload
from epdserve.bench.deployment_run import run_config
from epdserve.bench.deployments import Deployment, DeploymentFileError, ModelVariables, from_config, load
from epdserve.bench.processes import ServerError, server_command
from epdserve.bench.run import add_client_arguments, parse_rates, parse_share, write_json
from epdserve.model.loader import DEFAULT_VLM, ModelLoadError, resolve_model
from epdserve.serving.deployment import NAME_HELP, DeploymentSpec
from epdserve.bench.traces import describe
from epdserve.serving import flags

DEFAULT_CONFIGS = ["colocated", "pd"]


# compare.json's layout; 2 keeps every SLO's per-request value per run, what `report` rejudges.
VERSION = 2


def parse_configs(text: str) -> list[str]:
    """argparse type: comma-separated unique deployment names, in canonical form."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: no configuration named; {NAME_HELP}")
    try:
        names = [DeploymentSpec.parse(n).name for n in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a configuration is named twice")
    return names


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: port must be 1..65535")
    return port


CONFIGS_FLAG = Flag(
    "--configs", type=parse_configs, default=None, metavar="NAMES",
    help="epdserve deployments by name, in order: colocated, colocated-chunked, colocated-N (N replicas), pd, "
         "XpYd (X prefill, Y decode workers), XeYpZd (EPD: X encode, Y prefill, Z decode workers), pd-localN, "
         "elastic (2 workers that change role live, steering by the SLOs), elastic-N (N >= 2 such workers); "
         "NAME-tpS: every engine worker S tensor-parallel ranks, NAME-tpP/D: prefill workers P, decode D (as plan "
         "names them; not elastic, colocated-chunked, pd-localN), XeYpZd-tpE/P/D: encode workers E too; NAME-noprefix: prefix caching off. compare runs them (default colocated,pd unless --deployments is "
         "given; the first is the baseline of the ratio column); plan simulates them as compare's launcher "
         "places them on the --devices, with their scheduler settings (--max-num-seqs etc. do not apply), "
         "instead of every candidate")

def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload.add_workload_arguments(parser, default="demo")
    add_client_arguments(parser)
    CONFIGS_FLAG.add(parser)
    parser.add_argument("--deployments", nargs="+", default=None, metavar="FILE",
                        help="TOML files of [[deployment]] entries (epdserve deployments, "
                             "processes to start, or base URLs of running servers; see "
                             "docs/comparing.md and examples/deployments/), run after the "
                             "--configs ones")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="model directory or GGUF for the epdserve servers (default: the "
                             "default model; vlm, the default multimodal model, when the trace "
                             "has images); also sizes the prompts unless --tokenizer is given")
    parser.add_argument("--output", default="results/compare", metavar="DIR",
                        help="output directory (default results/compare)")
    parser.add_argument("--port", type=_port, default=8100,
                        help="epdserve router port on 127.0.0.1 (default 8100)")
    parser.add_argument("--startup-timeout", type=float_above(0), default=300.0, metavar="S",
                        help="seconds to wait for an epdserve deployment's /health == 200 "
                             "(default 300)")
    flags.ALLOW_OVERSUBSCRIPTION_FLAG.add(parser)
    parser.add_argument("--repeats", type=rounds.parse_repeats, default=rounds.AUTO, metavar="N|auto",
                        help="run every deployment N times, interleaved (A B A B ...: drift of "
                             "the machine hits each alike); the report gives each figure's "
                             "median and range. auto (the default): rounds until the paired "
                             "interval of the goodput difference tells the configurations apart "
                             "or shows a tie, or until --budget")
    parser.add_argument("--budget", type=float_above(0), default=None, metavar="MIN",
                        help="with --repeats auto: start no round that would end after MIN "
                             f"minutes (the first always runs; default {rounds.DEFAULT_BUDGET_MIN:g})")
    slo_map.SLO_GRID_FLAG.add(parser)
    s = parser.add_argument_group("goodput sweep (needs --goodput)")
    s.add_argument("--sweep-rates", type=parse_rates, default=None, metavar="LO:HI",
                   help="also find each configuration's highest request rate (req/s) within "
                        "the SLOs by bisection over LO..HI, replaying the trace re-timed to "
                        "each rate; draws goodput_vs_rate.png")
    s.add_argument("--goodput-target", type=parse_share, default=0.9, metavar="F",
                   help="share of requests that must meet every SLO (default 0.9)")
    s.add_argument("--sweep-iters", type=workload.nonnegative_int, default=3, metavar="N",
                   help="bisection steps after LO and HI (default 3)")


def server_model(model: str | None, requests: list[workload.Request]) -> str | None:
    """``model``, else ``vlm`` for a trace with images (the default model has no vision tower)."""
    if model is None and any(r.images for r in requests):
        return DEFAULT_VLM
    return model


class _Parser(argparse.ArgumentParser):
    """Errors raise instead of exiting."""

    def error(self, message: str):
        raise argparse.ArgumentError(None, message)


def preflight(args: Options, available_bytes: int | None,
              deployments: list[Deployment] | None = None) -> tuple[list[str], list[str]]:
    """``(warnings, errors)``, a line each, from the checks ``epdserve serve`` applies at start
    (placement, ranks, mode against model, memory against ``available_bytes``; None: unchecked):
    one the host cannot hold stops compare, so it never recommends the only survivor.

    Raises ModelLoadError."""
    from epdserve.serving.launch import launcher  # torch and the router: only here, not in the client
    from epdserve.serving.router.app import mode_error
    from epdserve.serving.launch.options import ServeOptions

    parser = _Parser()
    launcher.add_arguments(parser)
    if deployments is None:
        deployments = [from_config(n) for n in args.configs or DEFAULT_CONFIGS]
    warnings, errors = [], []
    for dep in (d for d in deployments if d.epdserve):
        model = dep.model or args.model
        cmd = server_command(dep.epdserve, args.port, Path("trace.jsonl"), model, [],
                             args.allow_oversubscription, slos(args)) + (dep.args or [])
        try:
            opts, unknown = parser.parse_known_args(cmd)
        except argparse.ArgumentError as exc:
            errors.append(f"[{dep.name}] args: {exc}")
            continue
        if unknown:
            errors.append(f"[{dep.name}] args: not epdserve serve options: {' '.join(unknown)}")
            continue
        try:
            opts = config_from(ServeOptions, opts)
            opts = replace(opts, router=replace(opts.router, model=launcher.model_from_tag(opts)))  # a MODEL arg
        except ValueError as exc:
            errors.append(f"[{dep.name}] args: {exc}")
            continue
        try:  # the placement and each worker's ranks, as serve checks them before starting any
            plan = launcher.checked_plan(opts)
        except ValueError as exc:
            errors.append(f"[{dep.name}] {exc}")
            continue
        info = resolve_model(opts.router.model)
        found, error = launcher.check_capacity(opts, plan, info.path, available_bytes)
        warnings += [f"[{dep.name}] {w}" for w in found]
        error = (mode_error(opts.router, info)
                 or (error and f"{error}; --allow-oversubscription starts it anyway"))
        if error:
            errors.append(f"[{dep.name}] {error}")
    return warnings, errors


def slos(args: Options) -> dict[str, float] | None:
    """``--goodput`` (ms) or None; elastic deployments steer by it."""
    return dict(args.goodput) if getattr(args, "goodput", None) else None


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def selected(args: Options) -> list[Deployment]:
    """``--configs`` (default colocated,pd without ``--deployments``), then the files' entries.

    Raises DeploymentFileError: a malformed file or a name used twice."""
    names = args.configs if args.configs is not None else (
        [] if args.deployments else DEFAULT_CONFIGS)
    chosen = [from_config(n) for n in names]
    for dep in load(args.deployments or []):
        if dep.name in names:
            raise DeploymentFileError(f"{dep.where()}: name: already used by --configs; "
                                      f"names must be unique")
        chosen.append(dep)
    return chosen


def _options_error(args: Options) -> str | None:
    if args.budget is not None and args.repeats != rounds.AUTO:
        return f"--budget is for --repeats auto, not --repeats {args.repeats}"
    if args.sweep_rates and not args.goodput:
        return "--sweep-rates needs SLOs: pass --goodput, e.g. --goodput ttft:2000 tpot:300"
    return slo_map.check_given(args.slo_grid)


def run(args: Options) -> int:
    error = _options_error(args)
    if error:
        print(f"epdserve compare: error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.output)
    try:
        chosen = selected(args)
        requests, spec = workload.build_from_args(args, tokenizer_path=args.model)
        client.check_sendable(requests, args.endpoint)
        args = with_values(args, model=server_model(args.model, requests))  # recorded in settings()
        for dep in chosen:  # every variable set, before anything starts
            dep.resolved_processes(ModelVariables(args.model))
        warnings, errors = preflight(args, host.mem_available_bytes(), chosen)
    except (DeploymentFileError, workload.TraceError, client.UnsupportedWorkload,
            ModelLoadError) as exc:
        print(f"epdserve compare: error: {exc}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"epdserve compare: warning: {line}", flush=True)
    for dep in chosen:
        if not dep.epdserve and not (dep.resources and (dep.resources.cpu_cores or dep.resources.gpus)):
            print(f"epdserve compare: warning: {dep.where()}: no resources.cpu_cores or "
                  f"resources.gpus: its per-device figures will be —", flush=True)
    if errors:
        for line in errors:
            print(f"epdserve compare: error: {line}", file=sys.stderr)
        print("epdserve compare: nothing run; drop those deployments from --configs or the --deployments files",
              file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    workload.save_trace(requests, out_dir / "trace.jsonl")
    print(f"trace: {len(requests)} requests -> {out_dir / 'trace.jsonl'}", flush=True)
    try:
        entries, status, stopped = _run_all(chosen, requests, args, out_dir)
    except KeyboardInterrupt:
        print("epdserve compare: interrupted; servers stopped", file=sys.stderr)
        return 130
    if not any("result" in e for e in entries):
        return status or 1

    rec = {**recommend.recommend(entries), "stopped": stopped}
    files = write_outputs(entries, requests, spec, out_dir, settings(args), rec)
    print_summary(entries, rec, out_dir, files)
    return status


def print_summary(entries: list[dict], rec: dict, out_dir: Path, files: list[Path]) -> None:
    print()
    print(report.text_table(entries))
    print()
    stages = server_metrics.stages_text([e for e in entries if "result" in e])
    if stages:
        print("Server-side stages from /metrics (deltas over the measured requests):")
        print(stages)
        print()
    disturbed = report.load_warnings(entries)
    print(report.recommendation_markdown(rec, disturbed))
    the_map = json.loads((out_dir / "compare.json").read_text())["slo_map"]
    if "cells" in the_map:
        print(f"\nWho wins at which SLOs (rows TTFT, columns longest gap; {out_dir / slo_map.PNG}):")
        print(slo_map.markdown(the_map))
    for line in disturbed:
        print(f"\nwarning: {line}")
    print(f"\nwritten: {', '.join(map(str, files))}")


def _run_all(chosen: list[Deployment], requests: list[workload.Request],
             args: Options, out_dir: Path) -> tuple[list[dict], int, str]:
    """(entries, exit status, why the rounds stopped); each run from a fresh start.

    Raises KeyboardInterrupt on Ctrl-C or SIGTERM, after stopping what it started."""
    status = 0

    def run_one(dep: Deployment, progress: str) -> dict:
        nonlocal status
        try:
            entry = run_config(dep, requests, args, out_dir, progress=progress)
            status = 1 if "died" in entry else status
            return entry
        except (ServerError, client.ClientError, sweep.SweepError) as exc:
            status = 1
            return _failed_entry(dep, exc)

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        runs, stopped = rounds.run_rounds(chosen, run_one, getattr(args, "repeats", 1),
                                          getattr(args, "budget", None) or rounds.DEFAULT_BUDGET_MIN)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(stopped, flush=True)
    return [repeats.combine(runs[dep.name]) for dep in chosen], status, stopped


def _failed_entry(dep: Deployment, exc: Exception) -> dict:
    reason = getattr(exc, "reason", None) or str(exc).splitlines()[0]
    tail = getattr(exc, "log_tail", "")
    print(f"epdserve compare: error: [{dep.name}] {reason}", file=sys.stderr)
    if tail:
        print(f"epdserve compare: [{dep.name}] last lines of its log:\n{tail}", file=sys.stderr)
    return {"name": dep.name, "mode": dep.entry_mode, "deployment": dep.record(),
            "error": reason, "log_tail": tail}


def settings(args: Options) -> dict:
    return {"endpoint": args.endpoint, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "warmup": args.warmup, "repeats": args.repeats,
            "budget_min": (getattr(args, "budget", None) or rounds.DEFAULT_BUDGET_MIN)
            if args.repeats == rounds.AUTO else None,
            "goodput": dict(args.goodput) if args.goodput else None, "model": args.model,
            "slo_grid": args.slo_grid}


def write_outputs(entries: list[dict], requests: list[workload.Request], spec: dict,
                  out_dir: Path, sampling: dict | None = None, rec: dict | None = None) -> list[Path]:
    """Paths written; ``rec`` defaults to the recommendation of ``entries``."""
    trace = out_dir / "trace.jsonl"
    if not trace.is_file():
        workload.save_trace(requests, trace)
    rec = rec or recommend.recommend(entries)
    the_map, section, map_png = slo_map.for_outputs(entries, rec["slos_ms"], (sampling or {}).get("slo_grid"), out_dir)
    if "cells" in the_map:
        rec["region"] = slo_map.region(the_map, rec["slos_ms"])
    write_json({"trace": {**spec, "file": str(trace), "num_requests": len(requests),
                          "sha256": hashlib.sha256(trace.read_bytes()).hexdigest()},
                "sampling": sampling or {}, "configs": entries, "recommendation": rec, "slo_map": the_map,
                "version": VERSION}, out_dir / "compare.json")
    md = report.markdown_report(entries, spec, describe(requests), sampling or {}, rec)
    (out_dir / "compare.md").write_text(md + "\n" + section)
    long_offsets = [r.offset_s for r in requests if r.kind == "long"]
    phase_starts = (spec.get("phase_windows") or {}).get("start_s", [])
    pngs = plots.plot_all([e for e in entries if "result" in e], long_offsets, out_dir, phase_starts)
    return [out_dir / "compare.json", out_dir / "compare.md", *pngs, *map_png]
