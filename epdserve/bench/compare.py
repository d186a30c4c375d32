"""``epdserve compare``: run ONE trace against each deployment and put the numbers side by
side.

For each configuration (``--configs colocated,pd``) in turn: start
``python -m epdserve serve --mode NAME --host 127.0.0.1 --port P --trace-file
DIR/NAME.server.jsonl`` in its own process group (output to ``DIR/NAME.server.log``), wait
until ``/health`` answers 200, send the trace with the bench client, stop the server
(SIGTERM to the group, SIGKILL after a grace period — also on errors and Ctrl-C), and
summarise its trace. Then write under ``--output DIR``:

* ``trace.jsonl`` — the trace sent to every configuration;
* ``compare.json`` — ``[{"name", "result": <bench result>, "server": <trace summary>}]``;
* ``compare.md`` — the comparison table and the workload;
* ``ttft_cdf.png``, ``itl_cdf.png``, ``itl_over_time.png``.

Exit status: 0 when every configuration ran, 1 when a server failed to start or answer,
2 for a bad option, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from epdserve.bench import client, plots, report, server_trace, workload
from epdserve.bench.run import add_client_arguments, bench, write_json


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

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll ``/health`` every 0.5 s until 200; returns the seconds it took.

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
                    if http.get(url).status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                if time.monotonic() - start > timeout_s:
                    raise ServerError(f"{self.name} server: {url} not 200 after {timeout_s:.0f} s;"
                                      f" last lines of {self.log_path}:\n"
                                      f"{log_tail(self.log_path)}")
                time.sleep(0.5)

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


def serve_flags(name: str) -> list[str] | None:
    """``epdserve serve`` flags of a configuration name, or None for an unknown name:
    ``colocated`` and ``pd`` (1P1D) as they are, ``colocated-N`` for N replicas, ``XpYd``
    for X prefill and Y decode workers (the field's xPyD notation)."""
    if name in ("colocated", "pd"):
        return ["--mode", name]
    if m := re.fullmatch(r"colocated-([1-9][0-9]*)", name):
        return ["--mode", "colocated", "--workers", m[1]]
    if m := re.fullmatch(r"([1-9][0-9]*)p([1-9][0-9]*)d", name):
        return ["--mode", "pd", "--prefill-workers", m[1], "--decode-workers", m[2]]
    return None


def parse_configs(text: str) -> list[str]:
    """argparse type for ``--configs``: comma-separated unique names that
    :func:`serve_flags` knows."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(serve_flags(n) is None for n in names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected names like colocated,pd,colocated-2,2p1d")
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
                             "colocated-N (N replicas), pd, XpYd (X prefill, Y decode workers); "
                             "the first is the baseline of the ratio column")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="model directory or GGUF for the servers (default: the default "
                             "model); also sizes the prompts unless --tokenizer is given")
    parser.add_argument("--output", default="results/compare", metavar="DIR",
                        help="output directory (default results/compare)")
    parser.add_argument("--port", type=_port, default=8100,
                        help="router port on 127.0.0.1 (default 8100)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="S",
                        help="seconds to wait for /health == 200 (default 300)")


SERVE = [sys.executable, "-m", "epdserve", "serve"]


def server_command(name: str, port: int, trace_file: Path, model: str | None,
                   serve: list[str] = SERVE) -> list[str]:
    """The ``epdserve serve`` command line of one configuration (``serve``: the program
    and sub-command that take the serve options; any stand-in with the same options)."""
    cmd = [*serve, *serve_flags(name), "--host", "127.0.0.1",
           "--port", str(port), "--trace-file", str(trace_file)]
    if model:
        cmd += ["--model", model]
    return cmd


def run_config(name: str, requests: list[workload.Request], args: argparse.Namespace,
               out_dir: Path, serve: list[str] = SERVE) -> dict:
    """Start the server of configuration ``name`` (see :func:`server_command`), run the
    trace, stop it; return the compare.json entry.

    Raises:
        ServerError: the server did not come up (or the port is taken).
        client.ClientError: it stopped answering before the run, or the warm-up failed.
    """
    if not port_is_free(args.port):
        raise ServerError(f"port {args.port} on 127.0.0.1 is already in use; "
                          f"stop what listens there or pass --port")
    trace_file = (out_dir / f"{name}.server.jsonl").resolve()
    trace_file.unlink(missing_ok=True)  # the router appends; start clean
    base_url = f"http://127.0.0.1:{args.port}"
    server = ServerProcess(name, server_command(name, args.port, trace_file, args.model, serve),
                           out_dir / f"{name}.server.log", base_url)
    print(f"[{name}] starting server: {' '.join(server.cmd)}", flush=True)
    try:
        server.start()
        took = server.wait_healthy(args.startup_timeout)
        print(f"[{name}] healthy after {took:.1f} s; sending {len(requests)} requests",
              flush=True)
        result = bench(base_url, requests, args)
    finally:
        server.stop()
    summary = server_trace.summarize(trace_file, result["request_ids"])
    print(f"[{name}] done: {result['completed']} completed, {result['failed']} failed, "
          f"{result['duration']:.1f} s", flush=True)
    return {"name": name, "result": result, "server": summary}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.output)
    try:
        requests, spec = workload.build_from_args(args, tokenizer_path=args.model)
    except workload.TraceError as exc:
        print(f"epdserve compare: error: {exc}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    workload.save_trace(requests, out_dir / "trace.jsonl")
    print(f"trace: {len(requests)} requests -> {out_dir / 'trace.jsonl'}", flush=True)

    entries, status = [], 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # clean up on kill too
    try:
        for name in args.configs:
            try:
                entries.append(run_config(name, requests, args, out_dir))
            except (ServerError, client.ClientError) as exc:
                print(f"epdserve compare: error: [{name}] {exc}", file=sys.stderr)
                status = 1
    except KeyboardInterrupt:
        print("epdserve compare: interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not entries:
        return status or 1

    files = write_outputs(entries, requests, spec, out_dir)
    print()
    print(report.text_table(entries))
    print(f"\nwritten: {', '.join(map(str, files))}")
    return status


def write_outputs(entries: list[dict], requests: list[workload.Request], spec: dict,
                  out_dir: Path) -> list[Path]:
    """Write compare.json, compare.md and the three plots under ``out_dir``."""
    write_json(entries, out_dir / "compare.json")
    md = report.markdown_report(entries, spec, workload.describe(requests))
    (out_dir / "compare.md").write_text(md)
    long_offsets = [r.offset_s for r in requests if r.kind == "long"]
    pngs = plots.plot_all(entries, long_offsets, out_dir)
    return [out_dir / "compare.json", out_dir / "compare.md", *pngs]
