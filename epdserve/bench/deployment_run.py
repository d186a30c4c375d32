"""One deployment's run for ``epdserve compare``: start it, send the trace, sweep the rate (each
rate on a fresh start), stop it, and build its compare.json entry."""

from __future__ import annotations

import os
import time
from pathlib import Path

from epdserve import host
from epdserve.bench import client, plots, server_metrics, server_trace, sweep, workload
from epdserve.bench.compare_options import CompareOptions
from epdserve.bench.deployments import Deployment, file_stem, from_config
from epdserve.bench.processes import SERVE, LaunchOptions, Running, ServerError, launched
from epdserve.bench.run import bench
from epdserve.serving.deployment import DeploymentSpec
from epdserve.bench.arrivals import retime


def run_config(deployment: str | Deployment, requests: list[workload.Request],
               options: CompareOptions, out_dir: Path, serve: list[str] = SERVE,
               progress: str = "") -> dict:
    """The compare.json entry (docs/comparing.md, "compare.json entries") of ``deployment``;
    ``serve`` starts epdserve deployments, ``progress`` prefixes log lines.

    Raises ServerError (not ready, or dead before the trace), client.ClientError (no answer before
    the run, failed warm-up), sweep.SweepError (a sweep without SLOs)."""
    dep = from_config(deployment) if isinstance(deployment, str) else deployment
    tag = f"[{progress} {dep.name}]" if progress else f"[{dep.name}]"
    entry: dict = {"name": dep.name, "mode": dep.entry_mode, "deployment": dep.record()}
    cores = sorted(os.sched_getaffinity(0))  # the launcher splits these among its workers
    before = host.quiet_check(cores)
    opts = LaunchOptions(options.port, options.model, options.startup_timeout,
                         options.allow_oversubscription, serve, options.slos)
    with launched(dep, out_dir, opts, lambda line: print(f"{tag} {line}", flush=True)) as running:
        entry["metrics_urls"] = running.metrics_urls
        during, priority = _run_trace(running, requests, options, entry, cores, tag)
    if options.rate_sweep.sweep_rates and not running.died:
        try:
            entry["sweep"] = _sweep(dep, requests, options, out_dir, opts, tag)
        except (ServerError, client.ClientError) as exc:  # the run's result stands
            entry["sweep_error"] = str(exc).splitlines()[0]
            print(f"{tag} error: the goodput sweep stopped: {entry['sweep_error']}", flush=True)
    if running.died:
        entry["died"] = running.died
        print(f"{tag} error: {running.died_reason()}; last lines of its log:\n"
              f"{running.died['log_tail']}", flush=True)
    entry["host_load"] = _host_load(cores, before, during, tag, priority, entry.get("client"))
    entry["memory_peak_bytes"] = during and during["deployment_rss_peak_bytes"]
    _add_summaries(entry, running.trace_file, _is_elastic(dep))
    result = entry["result"]
    print(f"{tag} done: {result['completed']} completed, {result['failed']} failed, "
          f"{result['duration']:.1f} s", flush=True)
    return entry


def _host_load(cores: list[int], before: dict | None, during: dict | None, tag: str,
               priority: dict | None = None, client_delay: dict | None = None) -> dict | None:
    """None without ``during`` (a base_url); prints its warnings."""
    warnings = [during and host.outside_warning(during["outside_share"], during["steal_share"], len(cores)),
                (priority or {}).get("error"), (client_delay or {}).get("warning")]
    for line in filter(None, warnings):
        print(f"{tag} warning: {line}", flush=True)
    if not during:
        return None
    return {"cores": cores, "before": before, "during": during, "priority": priority,
            "warning": "; ".join(filter(None, warnings)) or None}


def _client_delay(result: dict, requests: list[workload.Request], loop: dict) -> dict:
    """Sends count as late only without ``--max-concurrency`` (with it a send waits for a
    slot by design); the measured requests only."""
    skip = result.get("warmup_requests") or 0
    lates = [] if result.get("max_concurrency") else [
        max(0.0, sent - r.offset_s) for sent, r in zip(result["start_offsets"], requests[skip:])]
    late = sum(1 for x in lates if x >= host.CLIENT_LATE_S)
    worst = max((s[1] for s in loop["stalls"]), default=None)
    return {"loop": loop, "late_sends": late, "num_sends": len(lates),
            "max_send_late_s": round(max(lates, default=0.0), 3),
            "warning": host.client_warning(late, len(lates), max(lates, default=0.0), loop["stalled_s"], worst)}


def _run_trace(running: Running, requests: list[workload.Request], options: CompareOptions,
               entry: dict, cores: list[int], tag: str) -> tuple[dict | None, dict]:
    """Send the trace at the client's CPU priority, measuring the load and the client's delay;
    fills ``entry``, returns (load, priority). Raises ServerError when a dead process kept the
    run from starting."""
    # From here on: loading the model is not what the run measures.
    pids = running.root_pids
    priority = host.match_cpu_priority(pids)
    print(f"{tag} sending {len(requests)} requests", flush=True)
    monitor = host.LoadMonitor(cores, pids).start() if pids else None
    watcher = server_metrics.MetricsWatcher(running.metrics_urls)
    lag = client.LoopLag()

    def on_start() -> None:  # the trace's time 0
        if watcher.urls:
            watcher.start()
        entry["run_start_unix"] = time.time()
        lag.start()  # until the trace ends (asyncio.run cancels it)

    try:
        entry["result"] = bench(running.client_url, requests, options.client, model=running.model,
                                on_start=on_start, arrivals=options.workload.arrivals)
        entry["run_end_unix"] = time.time()
        entry["client"] = _client_delay(entry["result"], requests, lag.summary())
        entry["server_metrics"] = _stop_watcher(watcher, entry["result"]["completed"], tag)
        entry["resources"] = running.resources()
    except client.ClientError:
        if not running.died:
            raise
        if "result" not in entry:  # the cause, not the client's view of it
            raise ServerError(running.died_reason(), running.died["log_tail"]) from None
    finally:
        if "server_metrics" not in entry and watcher.urls:
            watcher.stop()  # the run failed: end the sampling thread, the numbers are moot
        load = monitor.stop() if monitor else None
    return load, priority


def _sweep(dep: Deployment, requests: list[workload.Request], options: CompareOptions,
           out_dir: Path, opts: LaunchOptions, tag: str) -> dict:
    """Each rate on a fresh start: a server that served the trace holds its prompts in its prefix
    cache (prefills of 3.8 s fell to 61 ms on a second pass, passing rates it could not serve).
    A base_url gets every rate as it is, with a warning. Raises ServerError, client.ClientError."""
    if dep.kind == "base_url":
        print(f"{tag} warning: {dep.name} is a running server (base_url): every sweep rate is sent to it "
              "as it is, and from the second on its prefix cache may hold the trace's prompts", flush=True)
    lo, hi = options.rate_sweep.sweep_rates
    print(f"{tag} goodput sweep over {lo}:{hi} req/s, "
          "each rate on a fresh start", flush=True)

    def measure(rate: float) -> dict:
        point_dir = out_dir / "sweep" / f"{file_stem(dep.name)}-{rate:g}"
        point_dir.mkdir(parents=True, exist_ok=True)
        cores = sorted(os.sched_getaffinity(0))
        with launched(dep, point_dir, opts, lambda line: print(f"{tag} [{rate:g} req/s] {line}", flush=True)
                      ) as running:
            priority = host.match_cpu_priority(running.root_pids)
            monitor = host.LoadMonitor(cores, running.root_pids).start() if running.root_pids else None
            try:
                result = bench(running.client_url, retime(requests, rate, options.workload.seed), options.client,
                               model=running.model, arrivals=options.workload.arrivals)
            finally:
                during = monitor.stop() if monitor else None
        if during:
            result["host_load"] = _host_load(cores, None, during, f"{tag} [{rate:g} req/s]", priority)
        return result

    return sweep.find_max_goodput_rate(measure, target_share=options.rate_sweep.goodput_target, lo=lo, hi=hi,
                                       iters=options.rate_sweep.sweep_iters,
                                       progress=not options.client.disable_tqdm)


def _stop_watcher(watcher: server_metrics.MetricsWatcher, completed: int, tag: str) -> dict:
    if not watcher.urls:
        return {}
    found = watcher.stop(completed_requests=completed)
    for line in found["warnings"]:
        print(f"{tag} warning: {line}", flush=True)
    return found


def _is_elastic(dep: Deployment) -> bool:
    return bool(dep.epdserve) and (DeploymentSpec.parse(dep.epdserve).elastic or "--elastic" in (dep.args or []))


def _add_summaries(entry: dict, trace_file: Path | None, elastic: bool = False) -> None:
    result = entry["result"]
    entry["itl_stalls"] = plots.itl_stalls(result)
    entry["roles_timeline"], entry["role_switches"] = {}, {}
    if trace_file is None:
        entry["server"], entry["breakdown"] = {}, {}
        return
    records, _ = server_trace.read(trace_file)
    entry["server"] = server_trace.summarize(trace_file, result["request_ids"])
    entry["breakdown"] = server_trace.breakdown(result, records)
    if elastic:
        roles = server_trace.role_timeline(trace_file, end_unix=entry.get("run_end_unix"))
        entry["roles_timeline"], entry["role_switches"] = roles["workers"], roles["switches"]
