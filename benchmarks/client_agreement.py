"""Our client against vLLM's: ``epdserve bench`` and ``vllm bench serve`` (from
``.venv-vllm``, ``make vllm``) on one epdserve server, each client's TTFT and ITL against
the server's own trace of the requests that client sent.

Server: ``epdserve serve --mode colocated`` with its router and worker on the last core
(``taskset`` and ``--cores``); both clients on the other cores, so that neither side's
timing includes waiting for a core the other holds. The server is warmed up first (a few
requests, not counted).

Per client and concurrency C (``--concurrency``, default 1 8): ``--num-prompts`` synthetic
chat requests of ``--input-len`` prompt tokens and ``--output-len`` output tokens (EOS
ignored), all due at once, C in flight. Then the trace lines the server wrote for that
run (the last N; vLLM's client sends one test request before its run).

* Server TTFT: ``ttft_ms``, HTTP arrival at the router to the first token leaving it.
* Server ITL: (``e2e_ms`` - ``ttft_ms``) / (output tokens - 1), token-weighted over the
  run; every request has the same output length, so it is also the mean TPOT.
* The client's: ``mean_ttft_ms``, ``mean_itl_ms`` and ``mean_tpot_ms`` of its result file
  (vLLM's format and definitions in both clients). A client's ITL is per chunk: tokens whose
  text the server holds back (an incomplete UTF-8 character, a possible stop string) reach
  it in one chunk, one longer gap where the server counts two. Its TPOT, (E2EL - TTFT) /
  (output tokens - 1), is per token, as the server's ITL.

Printed: one row per client and C with the client's and the server's means and their
ratios (goal: within 5 %); ``--output DIR`` gets ``client_agreement.json`` and the clients'
result files.

    .venv/bin/python benchmarks/client_agreement.py [--concurrency 1 8] [--num-prompts 16] \\
        [--input-len 256] [--output-len 64] [--output results/client_agreement]

Exit status 0 when every run completed, 1 otherwise (the message says which); the server
is stopped in every case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from epdserve.bench import workload
from epdserve.bench.processes import ServerError, ServerProcess
from epdserve.model.loader import resolve_model

ROOT = Path(__file__).resolve().parents[1]
VLLM = Path(os.environ.get("EPDSERVE_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "vllm"
CLIENTS = ("epdserve", "vllm")
TRACE_WAIT_S = 30.0  # for the server's last trace lines after a client exits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=workload.positive_int, nargs="+", default=[1, 8], metavar="C")
    p.add_argument("--num-prompts", type=workload.positive_int, default=16, metavar="N")
    p.add_argument("--input-len", type=workload.positive_int, default=256, metavar="T")
    p.add_argument("--output-len", type=workload.positive_int, default=64, metavar="T")
    p.add_argument("--port", type=workload.positive_int, default=8310)
    p.add_argument("--output", type=Path, default=Path("results/client_agreement"), metavar="DIR")
    return p.parse_args(argv)


def split_cores() -> tuple[list[int], list[int]]:
    """(server cores, client cores): the last usable core, and the rest (the same core
    for both on a one-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[-1:], cores[:-1] or cores[-1:]


def client_command(name: str, url: str, model_dir: Path, args, c: int, out: Path) -> list[str]:
    """One client run writing its vLLM-format result to ``out``."""
    if name == "epdserve":
        return [sys.executable, "-m", "epdserve", "bench", "--base-url", url, "--workload", "synthetic",
                "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts), "--max-concurrency", str(c), "--ignore-eos",
                "--warmup", "0", "--tokenizer", str(model_dir), "--disable-tqdm", "--save-result",
                "--result-dir", str(out.parent), "--result-filename", out.name]
    return [str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", url,
            "--endpoint", "/v1/chat/completions", "--model", "SmolLM2-135M-Instruct",
            "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(c), "--ignore-eos",
            "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name]


def trace_lines(path: Path) -> list[dict]:
    """The request records of the server's trace file (event lines left out)."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "request_id" in r]


def server_means(records: list[dict]) -> dict:
    """Mean TTFT and token-weighted ITL (ms) of trace records (module doc)."""
    ttft = sum(r["ttft_ms"] for r in records) / len(records)
    gaps = sum(r["output_tokens"] - 1 for r in records)
    itl = sum(r["e2e_ms"] - r["ttft_ms"] for r in records) / gaps
    return {"requests": len(records), "mean_ttft_ms": ttft, "mean_itl_ms": itl}


def run_client(name: str, url: str, model_dir: Path, args, c: int, trace: Path,
               client_cores: list[int]) -> dict:
    """One client run and the server's view of it.

    Raises:
        RuntimeError: the client failed, or the trace did not get its requests in time.
    """
    out = args.output / f"{name}-c{c}.json"
    before = len(trace_lines(trace))
    cmd = ["taskset", "-c", ",".join(map(str, client_cores)),
           *client_command(name, url, model_dir, args, c, out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} client at C={c} exited with {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    result = json.loads(out.read_text())
    deadline = time.monotonic() + TRACE_WAIT_S
    while len(trace_lines(trace)) - before < args.num_prompts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} at C={c}: the server traced "
                               f"{len(trace_lines(trace)) - before} of {args.num_prompts} requests")
        time.sleep(0.2)
    server = server_means(trace_lines(trace)[-args.num_prompts:])
    client = {k: result[k] for k in ("completed", "mean_ttft_ms", "mean_itl_ms", "mean_tpot_ms")}
    ratios = {k: client[k] / server[k] for k in ("mean_ttft_ms", "mean_itl_ms")}
    ratios["mean_tpot_ms"] = client["mean_tpot_ms"] / server["mean_itl_ms"]
    return {"client": client, "server": server, "ratio": ratios}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not VLLM.exists():
        print(f"client_agreement: {VLLM} not found: run make vllm", file=sys.stderr)
        return 1
    args.output.mkdir(parents=True, exist_ok=True)
    server_cores, client_cores = split_cores()
    model_dir = resolve_model(None).path
    trace = (args.output / "server.jsonl").resolve()
    trace.unlink(missing_ok=True)
    cores = ",".join(map(str, server_cores))
    url = f"http://127.0.0.1:{args.port}"
    server = ServerProcess("epdserve", ["taskset", "-c", cores, sys.executable, "-m", "epdserve", "serve",
                                        "--mode", "colocated", "--cores", cores, "--host", "127.0.0.1",
                                        "--port", str(args.port), "--trace-file", str(trace)],
                           args.output / "server.log", url)
    rows, status = {}, 0
    try:
        server.start()
        server.wait_healthy(600)
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 4})
        subprocess.run(client_command("epdserve", url, model_dir, warm, 2, args.output / "warmup.json"),
                       capture_output=True, timeout=600, check=True)
        for c in args.concurrency:
            for name in CLIENTS:
                try:
                    rows[f"{name} C={c}"] = run_client(name, url, model_dir, args, c, trace, client_cores)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(f"client_agreement: {exc}", file=sys.stderr)
                    status = 1
    except (ServerError, subprocess.SubprocessError) as exc:
        print(f"client_agreement: the server failed: {exc}", file=sys.stderr)
        status = 1
    finally:
        server.stop()
    print(f"server on core(s) {server_cores}, clients on {client_cores}; "
          f"{args.num_prompts} requests of {args.input_len} -> {args.output_len} tokens per run")
    print("means in ms; ratio = client / server (server ITL per token, as the client's TPOT)")
    print(f"{'run':<14} {'TTFT client':>11} {'server':>8} {'ratio':>6}   {'ITL client':>10} {'ratio':>6}   "
          f"{'TPOT client':>11} {'server ITL':>10} {'ratio':>6}")
    for run, r in rows.items():
        cl, sv, ra = r["client"], r["server"], r["ratio"]
        print(f"{run:<14} {cl['mean_ttft_ms']:>11.1f} {sv['mean_ttft_ms']:>8.1f} {ra['mean_ttft_ms']:>6.3f}   "
              f"{cl['mean_itl_ms']:>10.2f} {ra['mean_itl_ms']:>6.3f}   {cl['mean_tpot_ms']:>11.2f} "
              f"{sv['mean_itl_ms']:>10.2f} {ra['mean_tpot_ms']:>6.3f}")
    (args.output / "client_agreement.json").write_text(json.dumps(
        {"settings": {**vars(args), "output": str(args.output), "server_cores": server_cores,
                      "client_cores": client_cores}, "runs": rows}, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
