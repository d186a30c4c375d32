"""``epdserve bench``: send a seeded workload to an OpenAI-compatible server, print a
summary and write the result JSON (vLLM ``bench serve`` field names, see
:mod:`epdserve.bench.metrics`).

Example::

    epdserve bench --base-url http://127.0.0.1:8000 --workload demo --result-file out.json

Exit status: 0 when the run finished (failed requests are counted in the result, not in
the status), 1 when the server cannot be reached or the warm-up request fails, 2 for a
bad option or trace file, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from datetime import datetime
from pathlib import Path

from epdserve.bench import client, metrics, workload


def parse_goodput(text: str) -> tuple[str, float]:
    """argparse type for one SLO ``KEY:MS`` (KEY in ttft, tpot, e2el; MS >= 0)."""
    key, sep, value = text.partition(":")
    if not sep or key not in metrics.SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY:MS with KEY one of {', '.join(metrics.SLO_METRICS)}")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of ms") from None
    if not (ms >= 0) or math.isinf(ms):
        raise argparse.ArgumentTypeError(f"{text!r}: SLO must be a finite number >= 0 ms")
    return key, ms


def parse_base_url(text: str) -> str:
    """argparse type for a server URL: ``http://HOST:PORT`` (or https), no trailing slash."""
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://HOST:PORT")
    return text.rstrip("/")


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the client itself (shared with ``epdserve compare``)."""
    g = parser.add_argument_group("client")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="POST /v1/chat/completions (default) or /v1/completions")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at EOS (default: ignore_eos=true, so output "
                        "lengths are as asked)")
    g.add_argument("--goodput", nargs="+", type=parse_goodput, default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (ms)")
    g.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="per-read timeout of a request in seconds (default 600)")
    g.add_argument("--warmup", type=workload.nonnegative_int, default=1, metavar="N",
                   help="short unmeasured requests sent before the run (default 1)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, type=parse_base_url, help="server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests (default: first id of GET /v1/models)")
    workload.add_workload_arguments(parser)
    add_client_arguments(parser)
    parser.add_argument("--result-file", default=None, metavar="FILE",
                        help="write the result JSON here (default: not written)")


def bench(base_url: str, requests: list[workload.Request], args: argparse.Namespace,
          model: str | None = None) -> dict:
    """Run ``requests`` against ``base_url`` with the client options in ``args`` and return
    the result dict (metrics plus run settings).

    Raises:
        client.ClientError: the server does not answer, or the warm-up failed.
    """
    async def go() -> tuple[str, list[client.RequestRecord]]:
        name = model
        if name is None:
            async with client.make_client(1) as c:
                name = await client.fetch_model_name(c, base_url)
        records = await client.run_trace(
            base_url, name, requests, endpoint=args.endpoint, temperature=args.temperature,
            ignore_eos=args.ignore_eos, progress=not args.disable_tqdm,
            timeout_s=args.request_timeout, warmup=args.warmup)
        return name, records

    name, records = asyncio.run(go())
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"),
              "backend": "openai-chat" if args.endpoint == "chat" else "openai",
              "base_url": base_url, "model_id": name, "num_prompts": len(requests),
              "endpoint": args.endpoint, "temperature": args.temperature,
              "ignore_eos": args.ignore_eos}
    result.update(metrics.compute(records, dict(args.goodput) if args.goodput else None))
    return result


def summary_lines(result: dict) -> list[str]:
    """A short human-readable table of a result dict."""
    rows = [("Successful requests", f"{result['completed']}"),
            ("Failed requests", f"{result['failed']}"),
            ("Benchmark duration (s)", f"{result['duration']:.2f}"),
            ("Total input tokens", f"{result['total_input_tokens']}"),
            ("Total generated tokens", f"{result['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        rows.append((f"{title} mean / p50 / p99 (ms)",
                     f"{result[f'mean_{key}_ms']:.1f} / {result[f'median_{key}_ms']:.1f} / "
                     f"{result[f'p99_{key}_ms']:.1f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v:>22}" for k, v in rows]
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        lines.append(f"First error: {errors[0]}")
    return lines


def write_json(data, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    try:
        requests, spec = workload.build_from_args(args)
    except workload.TraceError as exc:
        print(f"epdserve bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = bench(args.base_url, requests, args, model=args.model)
    except client.ClientError as exc:
        print(f"epdserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epdserve bench: interrupted", file=sys.stderr)
        return 130
    result["workload"] = spec
    print("\n".join(summary_lines(result)))
    if args.result_file:
        write_json(result, args.result_file)
        print(f"result written to {args.result_file}")
    return 0
