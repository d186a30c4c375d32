"""``epdserve compare``: run ONE trace against each deployment and put the numbers side by
side.

First every configuration is checked as ``epdserve serve`` will check it
(:func:`preflight`): one the host cannot hold (memory) stops compare before any runs, so
that it never recommends the only survivor; workers sharing cores get a warning.

For each configuration (``--configs colocated,pd``) in turn: start
``python -m epdserve serve --mode NAME --host 127.0.0.1 --port P --trace-file
DIR/NAME.server.jsonl`` in its own process group (output to ``DIR/NAME.server.log``), wait
until ``/health`` answers 200, send the trace with the bench client, stop the server
(SIGTERM to the group, SIGKILL after a grace period — also on errors and Ctrl-C), and
summarise its trace. Around the run it records the load on the cores
(:mod:`epdserve.host`): a second before the server starts, and during the trace the load
average, CPU steal, and the CPU time of the deployment, of the bench client (this process)
and of every other process; a run in which others took :data:`~epdserve.host.OUTSIDE_SHARE_WARN`
or more of the cores is flagged on stdout and in compare.md. Then write under ``--output DIR``:

* ``trace.jsonl`` — the trace sent to every configuration;
* ``compare.json`` — ``{"trace", "sampling", "configs": [<entry>], "recommendation"}``
  (an entry: see :func:`run_config`; a configuration that failed is ``{"name", "error"}``);
* ``compare.md`` — the comparison table, the TTFT breakdown, the workload and the
  recommendation (:mod:`epdserve.bench.recommend`);
* ``ttft_cdf.png``, ``itl_cdf.png``, ``itl_over_time.png``, ``stages.png`` and, with
  ``--sweep-rates``, ``goodput_vs_rate.png``.

Every configuration gets the same trace, sampling settings and model (a trace with images
and no ``--model``: the default multimodal model, ``--model vlm``); the launcher pins
its workers to the same cores (all usable ones, split among workers), which ``/health``
lists and the entry records, so throughput and goodput are also reported per core.

Exit status: 0 when every configuration ran, 1 when a server failed to start or answer,
2 for a bad option or a configuration the host cannot hold, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from epdserve import host
from epdserve.bench import client, plots, recommend, report, server_trace, sweep, workload
from epdserve.bench.run import (add_client_arguments, bench, parse_rates, parse_share,
                                write_json)
from epdserve.model.loader import DEFAULT_VLM, ModelLoadError, resolve_model
from epdserve.serving.deployment import NAME_HELP, DeploymentSpec


class ServerError(RuntimeError):
    """A server that did not start or died; the message carries its log tail."""


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' if absent)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (we can bind it ourselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class ServerProcess:
    """One ``epdserve serve`` subprocess in its own process group."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, base_url: str):
        self.name, self.cmd, self.log_path, self.base_url = name, cmd, log_path, base_url
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_healthy(self, timeout_s: float, workers: int = 1) -> float:
        """Poll ``/health`` every 0.5 s until it answers 200 and, when its body lists
        ``workers`` (epdserve's does), at least ``workers`` of them are up: the router
        answers 200 as soon as one worker per role is up, and a run must not start before
        the others. Returns the seconds it took.

        Raises:
            ServerError: the process exited, or ``timeout_s`` passed.
        """
        start = time.monotonic()
        url = self.base_url + "/health"
        with httpx.Client(timeout=2.0, trust_env=False) as http:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise ServerError(f"{self.name} server exited with status {rc} before "
                                      f"{url} answered 200; last lines of {self.log_path}:\n"
                                      f"{log_tail(self.log_path)}")
                try:
                    answer = http.get(url)
                    if answer.status_code == 200 and _workers_up(answer.json()) >= workers:
                        return time.monotonic() - start
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() - start > timeout_s:
                    raise ServerError(f"{self.name} server: {url} not 200 with {workers} "
                                      f"workers up after {timeout_s:.0f} s; last lines of "
                                      f"{self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(0.5)

    def resources(self) -> dict:
        """``{"workers": [{"worker_id", "role", "cores"}], "cores": [...], "num_cores": n}``
        from ``/health`` (the CPU cores the launcher pinned each worker to); ``num_cores``
        is None when no worker lists its cores (e.g. a server that is not epdserve's)."""
        try:
            with httpx.Client(timeout=5.0, trust_env=False) as http:
                body = http.get(self.base_url + "/health").json()
        except (httpx.HTTPError, ValueError):
            body = {}
        if not isinstance(body, dict):
            body = {}
        workers = [{k: w.get(k) for k in ("worker_id", "role", "cores")}
                   for w in body.get("workers", []) if isinstance(w, dict)]
        cores = sorted({c for w in workers for c in (w["cores"] or [])})
        return {"workers": workers, "cores": cores, "num_cores": len(cores) or None}

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, wait up to ``grace_s``, then SIGKILL it."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        _killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + (grace_s if self.proc.returncode is not None else 0)
        while _group_alive(pgid) and time.monotonic() < deadline:  # workers still exiting
            time.sleep(0.2)
        if _group_alive(pgid):
            _killpg(pgid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None


def _workers_up(health: dict) -> float:
    """Workers in state "up" in a /health body; infinite when it lists none (a server
    that is not epdserve's: 200 is all it says)."""
    if not isinstance(health, dict) or not isinstance(health.get("workers"), list):
        return float("inf")
    return sum(1 for w in health["workers"] if isinstance(w, dict) and w.get("state") == "up")


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def parse_configs(text: str) -> list[str]:
    """argparse type for ``--configs``: comma-separated unique deployment names
    (:meth:`DeploymentSpec.parse <epdserve.serving.deployment.DeploymentSpec.parse>`),
    returned in their canonical form."""
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload.add_workload_arguments(parser, default="demo")
    add_client_arguments(parser)
    parser.add_argument("--configs", type=parse_configs, default=["colocated", "pd"],
                        help="deployments to compare, in order (default colocated,pd): colocated, "
                             "colocated-chunked, colocated-N (N replicas), pd, XpYd (X prefill, "
                             "Y decode workers), XeYpZd (EPD: X encode, Y prefill, Z decode "
                             "workers), pd-localN; NAME-noprefix: prefix caching off; "
                             "the first is the baseline of the ratio column")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="model directory or GGUF for the servers (default: the default "
                             "model; vlm, the default multimodal model, when the trace has "
                             "images); also sizes the prompts unless --tokenizer is given")
    parser.add_argument("--output", default="results/compare", metavar="DIR",
                        help="output directory (default results/compare)")
    parser.add_argument("--port", type=_port, default=8100,
                        help="router port on 127.0.0.1 (default 8100)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                        help="seconds to wait for /health == 200 (default 300)")
    parser.add_argument("--allow-oversubscription", action="store_true",
                        help="run configurations whose workers' estimated memory exceeds the "
                             "host's available memory (passed to epdserve serve)")
    s = parser.add_argument_group("goodput sweep (needs --goodput)")
    s.add_argument("--sweep-rates", type=parse_rates, default=None, metavar="LO:HI",
                   help="also find each configuration's highest request rate (req/s) within "
                        "the SLOs by bisection over LO..HI, replaying the trace re-timed to "
                        "each rate; draws goodput_vs_rate.png")
    s.add_argument("--goodput-target", type=parse_share, default=0.9, metavar="F",
                   help="share of requests that must meet every SLO (default 0.9)")
    s.add_argument("--sweep-iters", type=workload.nonnegative_int, default=3, metavar="N",
                   help="bisection steps after LO and HI (default 3)")


SERVE = [sys.executable, "-m", "epdserve", "serve"]


def server_model(model: str | None, requests: list[workload.Request]) -> str | None:
    """The ``--model`` the servers get: ``model`` when given; else, for a trace with
    images, ``vlm`` (the default multimodal model: the default model has no vision tower);
    else None (the default model)."""
    if model is None and any(r.images for r in requests):
        return DEFAULT_VLM
    return model


def server_command(name: str, port: int, trace_file: Path, model: str | None,
                   serve: list[str] = SERVE, allow_oversubscription: bool = False) -> list[str]:
    """The ``epdserve serve`` command line of one configuration (``serve``: the program
    and sub-command that take the serve options; any stand-in with the same options)."""
    cmd = [*serve, *DeploymentSpec.parse(name).serve_flags(), "--host", "127.0.0.1",
           "--port", str(port), "--trace-file", str(trace_file)]
    if model:
        cmd += ["--model", model]
    if allow_oversubscription:
        cmd.append("--allow-oversubscription")
    return cmd


def preflight(args: argparse.Namespace, available_bytes: int | None) -> tuple[list[str], list[str]]:
    """Check every configuration of ``args.configs`` before any runs, with the options and
    the check ``epdserve serve`` itself applies when it starts
    (:func:`epdserve.serving.launcher.check_capacity`; ``available_bytes``: the host's
    available memory, None: not checked). Returns ``(warnings, errors)``, one line each,
    prefixed with the configuration's name; an error is a configuration serve would refuse.

    Raises:
        ModelLoadError: ``args.model`` cannot be found or read.
    """
    from epdserve.serving import launcher  # torch and the router: only here, not in the client

    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    model_dir = resolve_model(args.model).path
    warnings, errors = [], []
    for name in args.configs:
        opts = parser.parse_args(server_command(name, args.port, Path("trace.jsonl"), args.model,
                                                [], args.allow_oversubscription))
        found, error = launcher.check_capacity(opts, launcher.plan_for(opts), model_dir,
                                               available_bytes)
        warnings += [f"[{name}] {w}" for w in found]
        if error:
            errors.append(f"[{name}] {error}")
    return warnings, errors


def run_config(name: str, requests: list[workload.Request], args: argparse.Namespace,
               out_dir: Path, serve: list[str] = SERVE, progress: str = "") -> dict:
    """Start the server of configuration ``name`` (see :func:`server_command`), wait until
    all its workers are up, run the trace (and the goodput sweep when ``args.sweep_rates``
    is set), read the cores its workers used from ``/health``, stop it; return the
    compare.json entry:

    ``{"name", "mode", "result": <bench result>, "server": <trace summary>,
    "resources": {"workers", "cores", "num_cores"}, "per_core": {"output_throughput"
    (tok/s/core), "request_goodput" (req/s/core or None)}, "itl_stalls": gaps > plots.STALL_MS,
    "breakdown": <server_trace.breakdown>, "sweep": <sweep result> (with --sweep-rates),
    "host_load": {"cores", "before": <host.quiet_check>, "during": <host.LoadMonitor.stop>,
    "warning": <host.outside_warning> or None}}``.
    ``progress`` prefixes the log lines (e.g. "2/4").

    Raises:
        ServerError: the server did not come up (or the port is taken).
        client.ClientError: it stopped answering before the run, or the warm-up failed.
        sweep.SweepError: a sweep result without ``slo_attainment`` (no SLOs given).
    """
    if not port_is_free(args.port):
        raise ServerError(f"port {args.port} on 127.0.0.1 is already in use; "
                          f"stop what listens there or pass --port")
    tag = f"[{progress} {name}]" if progress else f"[{name}]"
    trace_file = (out_dir / f"{name}.server.jsonl").resolve()
    trace_file.unlink(missing_ok=True)  # the router appends; start clean
    base_url = f"http://127.0.0.1:{args.port}"
    server = ServerProcess(name, server_command(name, args.port, trace_file, args.model, serve,
                                                args.allow_oversubscription),
                           out_dir / f"{name}.server.log", base_url)
    spec = DeploymentSpec.parse(name)
    entry: dict = {"name": name, "mode": spec.mode}
    cores = sorted(os.sched_getaffinity(0))  # the launcher splits these among its workers
    before = host.quiet_check(cores)
    print(f"{tag} starting server: {' '.join(server.cmd)}", flush=True)
    try:
        server.start()
        took = server.wait_healthy(args.startup_timeout, spec.num_workers)
        print(f"{tag} healthy after {took:.1f} s; sending {len(requests)} requests", flush=True)
        during = _run_trace(server, base_url, requests, args, entry, cores, tag)
    finally:
        server.stop()
    warning = host.outside_warning(during["outside_share"], during["steal_share"], len(cores))
    entry["host_load"] = {"cores": cores, "before": before, "during": during, "warning": warning}
    if warning:
        print(f"{tag} warning: {warning}", flush=True)
    _add_summaries(entry, trace_file)
    result = entry["result"]
    print(f"{tag} done: {result['completed']} completed, {result['failed']} failed, "
          f"{result['duration']:.1f} s", flush=True)
    return entry


def _run_trace(server: ServerProcess, base_url: str, requests: list[workload.Request],
               args: argparse.Namespace, entry: dict, cores: list[int], tag: str) -> dict:
    """Send the trace to the healthy server (and run the sweep with ``args.sweep_rates``)
    while measuring the load on ``cores``; puts ``result``, ``resources`` and ``sweep`` in
    ``entry`` and returns the load (:meth:`host.LoadMonitor.stop`)."""
    # From here on, not from the start: loading the model is not what the run measures.
    monitor = host.LoadMonitor(cores, server.proc.pid).start()
    try:
        entry["result"] = bench(base_url, requests, args)
        entry["resources"] = server.resources()
        if args.sweep_rates:
            print(f"{tag} goodput sweep over {args.sweep_rates[0]}:{args.sweep_rates[1]} req/s",
                  flush=True)
            entry["sweep"] = sweep.find_max_goodput_rate(
                lambda rate: bench(base_url, workload.retime(requests, rate, args.seed), args),
                target_share=args.goodput_target, lo=args.sweep_rates[0], hi=args.sweep_rates[1],
                iters=args.sweep_iters, progress=not args.disable_tqdm)
    finally:
        load = monitor.stop()
    return load


def _add_summaries(entry: dict, trace_file: Path) -> None:
    """What the server's trace and the bench result say, into ``entry``: ``server``,
    ``breakdown``, ``itl_stalls`` and ``per_core``."""
    result = entry["result"]
    records, _ = server_trace.read(trace_file)
    entry["server"] = server_trace.summarize(trace_file, result["request_ids"])
    entry["breakdown"] = server_trace.breakdown(result, records)
    entry["itl_stalls"] = plots.itl_stalls(result)
    cores = entry["resources"]["num_cores"]
    goodput = result.get("request_goodput")
    entry["per_core"] = {
        "output_throughput": result["output_throughput"] / cores if cores else None,
        "request_goodput": goodput / cores if cores and goodput is not None else None}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.sweep_rates and not args.goodput:
        print("epdserve compare: error: --sweep-rates needs SLOs: pass --goodput, e.g. "
              "--goodput ttft:2000 tpot:300", file=sys.stderr)
        return 2
    out_dir = Path(args.output)
    try:
        requests, spec = workload.build_from_args(args, tokenizer_path=args.model)
        client.check_sendable(requests, args.endpoint)
    except (workload.TraceError, client.UnsupportedWorkload) as exc:
        print(f"epdserve compare: error: {exc}", file=sys.stderr)
        return 2
    args.model = server_model(args.model, requests)  # recorded in settings()
    try:
        warnings, errors = preflight(args, host.mem_available_bytes())
    except ModelLoadError as exc:
        print(f"epdserve compare: error: {exc}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"epdserve compare: warning: {line}", flush=True)
    if errors:
        for line in errors:
            print(f"epdserve compare: error: {line}", file=sys.stderr)
        print("epdserve compare: nothing run; drop those configurations from --configs"
              + ("" if args.allow_oversubscription else " or pass --allow-oversubscription"),
              file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    workload.save_trace(requests, out_dir / "trace.jsonl")
    print(f"trace: {len(requests)} requests -> {out_dir / 'trace.jsonl'}", flush=True)

    entries, status = [], 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # clean up on kill too
    try:
        for i, name in enumerate(args.configs, 1):
            try:
                entries.append(run_config(name, requests, args, out_dir,
                                          progress=f"{i}/{len(args.configs)}"))
            except (ServerError, client.ClientError, sweep.SweepError) as exc:
                print(f"epdserve compare: error: [{name}] {exc}", file=sys.stderr)
                entries.append({"name": name, "mode": DeploymentSpec.parse(name).mode,
                                "error": str(exc).splitlines()[0]})
                status = 1
    except KeyboardInterrupt:
        print("epdserve compare: interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not any("result" in e for e in entries):
        return status or 1

    files = write_outputs(entries, requests, spec, out_dir, settings(args))
    print()
    print(report.text_table(entries))
    print()
    print(report.recommendation_markdown(recommend.recommend(entries)))
    for line in report.load_warnings(entries):
        print(f"\nwarning: {line}")
    print(f"\nwritten: {', '.join(map(str, files))}")
    return status


def settings(args: argparse.Namespace) -> dict:
    """The sampling and client settings every configuration ran with."""
    return {"endpoint": args.endpoint, "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "warmup": args.warmup,
            "goodput": dict(args.goodput) if args.goodput else None, "model": args.model}


def write_outputs(entries: list[dict], requests: list[workload.Request], spec: dict,
                  out_dir: Path, sampling: dict | None = None) -> list[Path]:
    """Write compare.json, compare.md and the plots under ``out_dir``; return their paths.

    ``entries``: :func:`run_config` entries and ``{"name", "error"}`` for configurations
    that failed; ``sampling``: :func:`settings` (the same for every configuration)."""
    trace = out_dir / "trace.jsonl"
    if not trace.is_file():
        workload.save_trace(requests, trace)
    rec = recommend.recommend(entries)
    write_json({"trace": {**spec, "file": str(trace), "num_requests": len(requests),
                          "sha256": hashlib.sha256(trace.read_bytes()).hexdigest()},
                "sampling": sampling or {}, "configs": entries, "recommendation": rec},
               out_dir / "compare.json")
    md = report.markdown_report(entries, spec, workload.describe(requests), sampling or {}, rec)
    (out_dir / "compare.md").write_text(md)
    long_offsets = [r.offset_s for r in requests if r.kind == "long"]
    pngs = plots.plot_all([e for e in entries if "result" in e], long_offsets, out_dir)
    return [out_dir / "compare.json", out_dir / "compare.md", *pngs]
