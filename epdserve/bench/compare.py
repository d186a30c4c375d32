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
from epdserve.argtypes import add_flags, config_from
from epdserve.bench import client, plots, recommend, repeats, report, rounds, server_metrics, slo_map, sweep, workload
from epdserve.bench.compare_options import CompareOptions, parse_configs  # noqa: F401 (parse_configs: read from here)
from epdserve.bench.deployment_run import run_config
from epdserve.bench.deployments import Deployment, DeploymentFileError, ModelVariables, from_config, load
from epdserve.bench.processes import ServerError, server_command
from epdserve.bench.run import write_json
from epdserve.model.loader import DEFAULT_VLM, ModelLoadError, resolve_model
from epdserve.bench.traces import describe

DEFAULT_CONFIGS = ["colocated", "pd"]


# compare.json's layout; 2 keeps every SLO's per-request value per run, what `report` rejudges.
VERSION = 2


OPTIONS = CompareOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CompareOptions)


def server_model(model: str | None, requests: list[workload.Request]) -> str | None:
    """``model``, else ``vlm`` for a trace with images (the default model has no vision tower)."""
    if model is None and any(r.images for r in requests):
        return DEFAULT_VLM
    return model


class _Parser(argparse.ArgumentParser):
    """Errors raise instead of exiting."""

    def error(self, message: str):
        raise argparse.ArgumentError(None, message)


def preflight(options: CompareOptions, available_bytes: int | None,
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
        deployments = [from_config(n) for n in options.configs or DEFAULT_CONFIGS]
    warnings, errors = [], []
    for dep in (d for d in deployments if d.epdserve):
        model = dep.model or options.model
        cmd = server_command(dep.epdserve, options.port, Path("trace.jsonl"), model, [],
                             options.allow_oversubscription, options.slos) + (dep.args or [])
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


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def selected(options: CompareOptions) -> list[Deployment]:
    """``--configs`` (default colocated,pd without ``--deployments``), then the files' entries.

    Raises DeploymentFileError: a malformed file or a name used twice."""
    names = options.configs if options.configs is not None else (
        [] if options.deployments else DEFAULT_CONFIGS)
    chosen = [from_config(n) for n in names]
    for dep in load(options.deployments or []):
        if dep.name in names:
            raise DeploymentFileError(f"{dep.where()}: name: already used by --configs; "
                                      f"names must be unique")
        chosen.append(dep)
    return chosen


def _options_error(options: CompareOptions) -> str | None:
    if options.budget is not None and options.repeats != rounds.AUTO:
        return f"--budget is for --repeats auto, not --repeats {options.repeats}"
    if options.rate_sweep.sweep_rates and not options.client.goodput:
        return "--sweep-rates needs SLOs: pass --goodput, e.g. --goodput ttft:2000 tpot:300"
    return slo_map.check_given(options.slo_grid)


def run(options: CompareOptions) -> int:
    error = _options_error(options)
    if error:
        print(f"epdserve compare: error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(options.output)
    try:
        chosen = selected(options)
        requests, spec = workload.build_from_args(options.workload, tokenizer_path=options.model)
        client.check_sendable(requests, options.client.endpoint)
        options = replace(options, model=server_model(options.model, requests))  # recorded in settings()
        for dep in chosen:  # every variable set, before anything starts
            dep.resolved_processes(ModelVariables(options.model))
        warnings, errors = preflight(options, host.mem_available_bytes(), chosen)
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
        entries, status, stopped = _run_all(chosen, requests, options, out_dir)
    except KeyboardInterrupt:
        print("epdserve compare: interrupted; servers stopped", file=sys.stderr)
        return 130
    if not any("result" in e for e in entries):
        return status or 1

    rec = {**recommend.recommend(entries), "stopped": stopped}
    files = write_outputs(entries, requests, spec, out_dir, settings(options), rec)
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
             options: CompareOptions, out_dir: Path) -> tuple[list[dict], int, str]:
    """(entries, exit status, why the rounds stopped); each run from a fresh start.

    Raises KeyboardInterrupt on Ctrl-C or SIGTERM, after stopping what it started."""
    status = 0

    def run_one(dep: Deployment, progress: str) -> dict:
        nonlocal status
        try:
            entry = run_config(dep, requests, options, out_dir, progress=progress)
            status = 1 if "died" in entry else status
            return entry
        except (ServerError, client.ClientError, sweep.SweepError) as exc:
            status = 1
            return _failed_entry(dep, exc)

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        runs, stopped = rounds.run_rounds(chosen, run_one, options.repeats,
                                          options.budget or rounds.DEFAULT_BUDGET_MIN)
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


def settings(options: CompareOptions) -> dict:
    c = options.client
    return {"endpoint": c.endpoint, "temperature": c.temperature,
            "ignore_eos": c.ignore_eos, "warmup": c.warmup, "repeats": options.repeats,
            "budget_min": (options.budget or rounds.DEFAULT_BUDGET_MIN)
            if options.repeats == rounds.AUTO else None,
            "goodput": options.slos, "model": options.model, "slo_grid": options.slo_grid}


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
