"""One deployment's run for ``epdserve compare``: start it, send the trace, sweep the
request rate (each rate on a fresh start), read its resources and server-side numbers,
stop it; the compare.json entry (:func:`run_config`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from epdserve.argtypes import Options
from epdserve import host
from epdserve.bench import client, plots, server_metrics, server_trace, sweep, workload
from epdserve.bench.deployments import Deployment, file_stem, from_config
from epdserve.bench.processes import SERVE, LaunchOptions, Running, ServerError, launched
from epdserve.bench.run import bench
from epdserve.serving.deployment import DeploymentSpec
from epdserve.bench.arrivals import retime


def run_config(deployment: str | Deployment, requests: list[workload.Request],
               args: Options, out_dir: Path, serve: list[str] = SERVE,
               progress: str = "") -> dict:
    """Start ``deployment`` (a ``--configs`` name or a deployments-file entry), wait until
    it is ready, run the trace (and the goodput sweep when ``args.sweep_rates`` is set),
    read its resources, stop it; return the compare.json entry:

    ``{"name", "mode" ("colocated", "pd", "epd" or None), "deployment": <the entry as parsed>, "metrics_urls",
    "result": <bench result>, "server": <trace summary, {} without an epdserve trace>, "resources": {"workers",
    "cores", "num_cores", "device_kind", "num_devices", "price_per_hour"}, "itl_stalls": gaps > plots.STALL_MS,
    "breakdown": <server_trace.breakdown, {} without a trace>, "server_metrics":
    <server_metrics.MetricsWatcher.stop over the measured requests, {} without metrics URLs>, "sweep": <sweep
    result> (with --sweep-rates: :func:`_sweep`; "sweep_error" instead when a start or run of the sweep failed),
    "host_load": {"cores", "before": <host.quiet_check>, "during": <host.LoadMonitor.stop>, "priority":
    <host.match_cpu_priority>, "warning": <its warnings "; "-joined, or None>} (None for a base_url deployment:
    its CPU time cannot be told from others'), "client": <:func:`_client_delay`: the bench client's own delay>,
    "died": <see :class:`~epdserve.bench.processes.Running`> (only when a process died), "run_start_unix",
    "run_end_unix": <time.time() when the trace's first request was due (the origin of ``start_offsets``, up to
    the few ms it takes to start the first send) and when its last request ended>, "memory_peak_bytes": <its
    processes' peak resident memory (None for a base_url deployment)>, "roles_timeline":
    <server_trace.role_timeline's "workers">, "role_switches": <its "switches"> (both ``{}`` but for an elastic
    deployment)}``.
    ``serve``: the command epdserve deployments start with; ``progress`` prefixes the log
    lines (e.g. "2/4").

    Raises:
        ServerError: it did not get ready (a taken port, a process that exited, a timeout,
            not an OpenAI server), or it died before the trace ran.
        client.ClientError: it stopped answering before the run, or the warm-up failed.
        sweep.SweepError: a sweep result without ``slo_attainment`` (no SLOs given).
    """
    dep = from_config(deployment) if isinstance(deployment, str) else deployment
    tag = f"[{progress} {dep.name}]" if progress else f"[{dep.name}]"
    entry: dict = {"name": dep.name, "mode": dep.entry_mode, "deployment": dep.record()}
    cores = sorted(os.sched_getaffinity(0))  # the launcher splits these among its workers
    before = host.quiet_check(cores)
    opts = LaunchOptions(args.port, args.model, args.startup_timeout,
                         args.allow_oversubscription, serve,
                         dict(args.goodput) if getattr(args, "goodput", None) else None)
    with launched(dep, out_dir, opts, lambda line: print(f"{tag} {line}", flush=True)) as running:
        entry["metrics_urls"] = running.metrics_urls
        during, priority = _run_trace(running, requests, args, entry, cores, tag)
    if args.sweep_rates and not running.died:
        try:
            entry["sweep"] = _sweep(dep, requests, args, out_dir, opts, tag)
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
    """``host_load`` of an entry (or of a sweep point: no ``before``, no ``client_delay``),
    None without ``during`` (a base_url deployment); prints its warnings: other processes'
    load (:func:`host.outside_warning`), a priority not matched, the client's own delay."""
    warnings = [during and host.outside_warning(during["outside_share"], during["steal_share"], len(cores)),
                (priority or {}).get("error"), (client_delay or {}).get("warning")]
    for line in filter(None, warnings):
        print(f"{tag} warning: {line}", flush=True)
    if not during:
        return None
    return {"cores": cores, "before": before, "during": during, "priority": priority,
            "warning": "; ".join(filter(None, warnings)) or None}


def _client_delay(result: dict, requests: list[workload.Request], loop: dict) -> dict:
    """How much the bench client itself held the run up: ``{"loop": <client.LoopLag.summary>,
    "late_sends", "num_sends", "max_send_late_s", "warning": <host.client_warning>}``. A
    send is compared with its scheduled offset only without ``--max-concurrency`` (with it,
    a send waits for a slot by design); the measured requests only (after
    ``--warmup-requests``)."""
    skip = result.get("warmup_requests") or 0
    lates = [] if result.get("max_concurrency") else [
        max(0.0, sent - r.offset_s) for sent, r in zip(result["start_offsets"], requests[skip:])]
    late = sum(1 for x in lates if x >= host.CLIENT_LATE_S)
    worst = max((s[1] for s in loop["stalls"]), default=None)
    return {"loop": loop, "late_sends": late, "num_sends": len(lates),
            "max_send_late_s": round(max(lates, default=0.0), 3),
            "warning": host.client_warning(late, len(lates), max(lates, default=0.0), loop["stalled_s"], worst)}


def _run_trace(running: Running, requests: list[workload.Request], args: Options,
               entry: dict, cores: list[int], tag: str) -> tuple[dict | None, dict]:
    """Give the ready deployment the client's CPU priority (:func:`host.match_cpu_priority`)
    and send it the trace while measuring the load on ``cores`` and the client's own delay
    (:func:`_client_delay`); puts ``result``, ``client``, ``server_metrics`` and
    ``resources`` in ``entry`` and returns ``(load, priority)``: the load
    (:meth:`host.LoadMonitor.stop`; None for a base_url deployment) and what
    :func:`host.match_cpu_priority` returned.

    Raises:
        ServerError: a process died and the client could not even start the run.
    """
    # From here on, not from the start: loading the model is not what the run measures.
    pids = running.root_pids
    priority = host.match_cpu_priority(pids)
    print(f"{tag} sending {len(requests)} requests", flush=True)
    monitor = host.LoadMonitor(cores, pids).start() if pids else None
    # The server's own view of the same requests: from after the warm-up to the run's end.
    watcher = server_metrics.MetricsWatcher(running.metrics_urls)
    lag = client.LoopLag()

    def on_start() -> None:  # right before the first request is due: the trace's time 0
        if watcher.urls:
            watcher.start()
        entry["run_start_unix"] = time.time()
        lag.start()  # runs on the client's loop until the trace ends (asyncio.run cancels it)

    try:
        entry["result"] = bench(running.client_url, requests, args, model=running.model,
                                on_start=on_start)
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


def _sweep(dep: Deployment, requests: list[workload.Request], args: Options,
           out_dir: Path, opts: LaunchOptions, tag: str) -> dict:
    """The goodput sweep (:func:`sweep.find_max_goodput_rate`) of ``dep``: the trace
    re-timed to each rate, each rate on a fresh start of the deployment, its logs and
    server trace under ``DIR/sweep/NAME-RATE/``, each point with its ``host_load``.

    A fresh start because a server that served the trace holds its prompts in its prefix
    cache: sent again, they are cache hits. Sweeping the running server, a synthetic trace
    (100-300 prompt tokens, 2 cores) had prefills of 3.8 s median on its first pass and
    61 ms on every later one, and so "passed" rates it could not serve. A base_url
    deployment (not ours to restart) gets every rate on the same server, with a warning.

    Raises:
        ServerError, client.ClientError: a start or a run failed (the sweep ends there).
    """
    if dep.kind == "base_url":
        print(f"{tag} warning: {dep.name} is a running server (base_url): every sweep rate is sent to it "
              "as it is, and from the second on its prefix cache may hold the trace's prompts", flush=True)
    print(f"{tag} goodput sweep over {args.sweep_rates[0]}:{args.sweep_rates[1]} req/s, "
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
                result = bench(running.client_url, retime(requests, rate, args.seed), args,
                               model=running.model)
            finally:
                during = monitor.stop() if monitor else None
        if during:
            result["host_load"] = _host_load(cores, None, during, f"{tag} [{rate:g} req/s]", priority)
        return result

    return sweep.find_max_goodput_rate(measure, target_share=args.goodput_target, lo=args.sweep_rates[0],
                                       hi=args.sweep_rates[1], iters=args.sweep_iters,
                                       progress=not args.disable_tqdm)


def _stop_watcher(watcher: server_metrics.MetricsWatcher, completed: int, tag: str) -> dict:
    """The watcher's stages (``{}`` without metrics URLs); prints its warnings."""
    if not watcher.urls:
        return {}
    found = watcher.stop(completed_requests=completed)
    for line in found["warnings"]:
        print(f"{tag} warning: {line}", flush=True)
    return found


def _is_elastic(dep: Deployment) -> bool:
    """Whether ``dep`` is an epdserve deployment whose workers may change role: an elastic
    name, or ``--elastic`` among its extra serve ``args``."""
    return bool(dep.epdserve) and (DeploymentSpec.parse(dep.epdserve).elastic or "--elastic" in (dep.args or []))


def _add_summaries(entry: dict, trace_file: Path | None, elastic: bool = False) -> None:
    """What the server's trace (epdserve's; none for other deployments) and the bench
    result say, into ``entry``: ``server``, ``breakdown``, ``itl_stalls``, and (of an
    ``elastic`` deployment; else ``{}``) ``roles_timeline`` and ``role_switches``."""
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
