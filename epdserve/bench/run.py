"""``epdserve bench``: send a seeded workload to an OpenAI-compatible server, print a summary and
write the result JSON as ``vllm bench serve`` does (fields, options, file name); exit status in
docs/comparing.md, "epdserve bench"."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from epdserve.argtypes import Options, float_above, float_at_least, slo_pair, with_values
from epdserve.bench import client, metrics, sweep, workload
from epdserve.bench.result_file import add_result_arguments, file_name, options_error
from epdserve.bench.arrivals import retime


# One ``KEY:MS`` SLO (metrics.SLO_METRICS); also ``epdserve plan --slo``'s type.
parse_goodput = slo_pair(metrics.SLO_METRICS)


def parse_base_url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected http://HOST:PORT")
    return text.rstrip("/")


# Ours, and the paths vLLM's `bench serve --endpoint` takes.
ENDPOINTS = {"chat": "chat", "completions": "completions",
             "/v1/chat/completions": "chat", "/v1/completions": "completions"}


def endpoint_arg(text: str) -> str:
    """argparse type: "chat" or "completions", or vLLM's path form."""
    try:
        return ENDPOINTS[text.rstrip("/") if text.startswith("/") else text]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(ENDPOINTS)}") from None


def add_client_arguments(parser: argparse.ArgumentParser, replay: bool = True) -> None:
    """``replay`` (compare): ``ignore_eos`` unless ``--no-ignore-eos``, so every deployment
    generates the trace's output lengths; else vLLM's ``--ignore-eos``."""
    g = parser.add_argument_group("client")
    g.add_argument("--endpoint", type=endpoint_arg, default="chat", metavar="chat|completions|PATH",
                   help="POST /v1/chat/completions (chat, the default) or /v1/completions "
                        "(completions); vLLM's path form is taken too")
    g.add_argument("--temperature", type=float_at_least(0), default=0.0, help="sampling temperature (default 0)")
    if replay:
        g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="let the model stop at EOS (default: ignore_eos=true, so every deployment "
                            "generates the trace's output lengths)")
    else:
        g.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos, so output lengths are as asked (as vLLM, always on for the "
                            "synthetic (random), demo, mooncake and azure workloads and a --trace replay; "
                            "off by default for prefix and sharegpt)")
    g.add_argument("--goodput", nargs="+", type=parse_goodput, default=None, metavar="KEY:MS",
                   help="SLOs for goodput in ms, e.g. ttft:2000 tpot:200 itl:1000: ttft, tpot "
                        "(the request's mean gap, as vLLM), e2el, itl (the request's longest "
                        "inter-token gap: a stall fails it, the mean hides it), itl_p99 (its "
                        "p99 gap); compare judges by " + " ".join(
                            f"{k}:{v:g}" for k, v in metrics.DEFAULT_SLOS_MS.items())
                        + " when none are given")
    g.add_argument("--request-timeout", type=float_above(0), default=600.0, metavar="S",
                   help="per-read timeout of a request in seconds (default 600)")
    g.add_argument("--warmup", type=workload.nonnegative_int, default=1, metavar="N",
                   help="short unmeasured requests sent before the run (default 1)")
    g.add_argument("--warmup-requests", type=workload.nonnegative_int, default=0, metavar="K",
                   help="the first K requests of the trace are sent as scheduled but left "
                        "out of the results (default 0)")
    g.add_argument("--max-concurrency", type=workload.positive_int, default=None, metavar="C",
                   help="at most C requests in flight; later ones wait for a slot (with "
                        "--request-rate inf: a closed loop of C clients)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, type=parse_base_url, help="server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help="model name sent in requests (default: first id of GET /v1/models)")
    workload.add_workload_arguments(parser)
    add_client_arguments(parser, replay=False)
    add_result_arguments(parser)
    sw = parser.add_argument_group("goodput sweep")
    sw.add_argument("--sweep", action="store_true",
                    help="find the highest request rate meeting --goodput for a share "
                         "--goodput-target of requests (bisection on rate)")
    sw.add_argument("--goodput-target", type=parse_share, default=0.9, metavar="F",
                    help="share of requests that must meet every SLO (default 0.9)")
    sw.add_argument("--sweep-rates", type=parse_rates, default=(0.25, 4.0), metavar="LO:HI",
                    help="request rates (req/s) bracketing the search (default 0.25:4)")
    sw.add_argument("--sweep-iters", type=workload.nonnegative_int, default=4, metavar="N",
                    help="bisection steps after LO and HI (default 4)")


def parse_share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a share in (0, 1], e.g. 0.9")
    return value


def parse_rates(text: str) -> tuple[float, float]:
    """argparse type: ``LO:HI`` req/s, 0 < LO < HI < inf."""
    lo, sep, hi = text.partition(":")
    try:
        rates = (float(lo), float(hi))
    except ValueError:
        rates = (math.nan, math.nan)
    if not sep or not (0 < rates[0] < rates[1] < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO:HI req/s with 0 < LO < HI")
    return rates


def _rate_field(rate: float | None, requests: list[workload.Request]) -> float | str:
    """vLLM's ``request_rate``: the asked rate, "inf", or without one the trace's mean rate."""
    if rate is None:
        span = max(r.offset_s for r in requests) - min(r.offset_s for r in requests)
        rate = (len(requests) - 1) / span if span > 0 else math.inf
    return "inf" if math.isinf(rate) else rate


def bench(base_url: str, requests: list[workload.Request], args: Options,
          model: str | None = None, request_rate: float | None = None,
          on_start: Callable[[], None] | None = None, tokenizer_id: str | None = None) -> dict:
    """The result dict: metrics over all but the first ``args.warmup_requests`` requests, and
    the run's settings under vLLM's names; ``on_start`` runs after the warm-up.

    Raises client.ClientError (no answer, failed warm-up, unsendable trace), and TraceError when
    ``--warmup-requests`` leaves nothing to measure."""
    skip = getattr(args, "warmup_requests", 0)
    if skip >= len(requests):
        raise workload.TraceError(f"--warmup-requests {skip}: the trace has only "
                                  f"{len(requests)} requests, none would be measured")
    concurrency = getattr(args, "max_concurrency", None)

    async def go() -> tuple[str, list[client.RequestRecord]]:
        name = model
        if name is None:
            async with client.make_client(1) as c:
                name = await client.fetch_model_name(c, base_url)
        records = await client.run_trace(
            base_url, name, requests, endpoint=args.endpoint, temperature=args.temperature,
            ignore_eos=args.ignore_eos, progress=not args.disable_tqdm,
            timeout_s=args.request_timeout, warmup=args.warmup, max_concurrency=concurrency,
            on_start=on_start)
        return name, records

    client.check_sendable(requests, args.endpoint)  # before any connection: the trace's fault
    name, records = asyncio.run(go())
    ramp = (getattr(args, "ramp_up_start_rps", None), getattr(args, "ramp_up_end_rps", None))
    backend = "openai-chat" if args.endpoint == "chat" else "openai"
    # vLLM's order: setup, metadata, traffic, then the metrics.
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
              "label": getattr(args, "label", None), "model_id": name, "tokenizer_id": tokenizer_id,
              "num_prompts": len(requests) - skip, **dict(getattr(args, "metadata", None) or ()),
              "request_rate": _rate_field(request_rate or getattr(args, "request_rate", None), requests),
              "burstiness": getattr(args, "burstiness", 1.0), "max_concurrency": concurrency}
    if ramp[0] is not None and request_rate is None:
        result.update(ramp_up_strategy="linear", ramp_up_start_rps=ramp[0],
                      ramp_up_end_rps=ramp[1])
    result.update(base_url=base_url, endpoint=args.endpoint, temperature=args.temperature,
                  ignore_eos=args.ignore_eos, read_timeout=args.request_timeout, warmup_requests=skip)
    result.update(metrics.compute(records[skip:], dict(args.goodput) if args.goodput else None,
                                  getattr(args, "metric_percentiles", metrics.PERCENTILES),
                                  getattr(args, "percentile_metrics", metrics.PERCENTILE_METRICS)))
    return result


def summary_lines(result: dict) -> list[str]:
    failed = f"{result['failed']}"
    if result.get("error_counts"):
        failed += " (" + ", ".join(f"{k} x{n}" for k, n in result["error_counts"].items()) + ")"
    rows = [("Successful requests", f"{result['completed']}"),
            ("Failed requests", failed),
            ("Benchmark duration (s)", f"{result['duration']:.2f}"),
            ("Total input tokens", f"{result['total_input_tokens']}"),
            ("Total generated tokens", f"{result['total_output_tokens']}"),
            ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.2f}")]
    if "max_output_tokens_per_s" in result:
        rows += [("Peak output token throughput (tok/s)",
                  f"{result['max_output_tokens_per_s']:.0f}"),
                 ("Peak concurrent requests", f"{result['max_concurrent_requests']}")]
    if result.get("max_concurrency") is not None:
        rows.append(("Max concurrency (client cap)", f"{result['max_concurrency']}"))
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", f"{result['request_goodput']:.2f}"))
        rows.append(("SLO attainment", f"{result['slo_attainment']:.1%}"))
    for key in metrics.PERCENTILE_METRICS:  # those the result has, with its percentiles
        stats = [(k.split("_")[0], v) for k, v in result.items()
                 if k.endswith(f"_{key}_ms") and not k.startswith("std_")]
        if stats:
            rows.append((f"{key.upper()} {' / '.join(s for s, _ in stats)} (ms)",
                         " / ".join(f"{v:.1f}" for _, v in stats)))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v:>22}" if len(v) <= 22 else f"{k:<{width}}  {v}"
             for k, v in rows]
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        lines.append(f"First error: {errors[0]}")
    return lines


def write_json(data, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def sweep_table(result: dict) -> list[str]:
    lines = [f"{'rate':>8} {'attain':>7} {'thru':>7} {'goodput':>8} {'p99 TTFT':>9} "
             f"{'p99 TPOT':>9} {'failed':>6}   (req/s, ms)"]
    for p in result["points"]:
        p99 = [f"{p[k]:>9.1f}" if k in p else f"{'—':>9}" for k in ("p99_ttft_ms", "p99_tpot_ms")]
        lines.append(f"{p['rate']:>8.3f} {p['slo_attainment']:>7.1%} "
                     f"{p['request_throughput']:>7.3f} {p['request_goodput']:>8.3f} "
                     f"{p99[0]} {p99[1]} {p['failed']:>6}")
    best = result["max_rate"]
    lines.append(f"Max rate with >= {result['target_share']:.0%} of requests within SLOs: "
                 + (f"{best:.3f} req/s" if best is not None else "none (even the lowest "
                    "rate misses; lower --sweep-rates)")
                 + (" (the highest rate tried: raise --sweep-rates)"
                    if best is not None and result["bracket"][1] is None else ""))
    return lines


def run_sweep(args: Options, requests: list[workload.Request], spec: dict) -> dict:
    def measure(rate: float) -> dict:
        return bench(args.base_url, retime(requests, rate, args.seed), args,
                     model=args.model, request_rate=rate)

    lo, hi = args.sweep_rates
    result = sweep.find_max_goodput_rate(measure, args.goodput_target, lo, hi,
                                         args.sweep_iters, progress=not args.disable_tqdm)
    result.update(goodput_slos_ms=dict(args.goodput), workload=spec,
                  sweep_rates=[lo, hi], sweep_iters=args.sweep_iters)
    return result


def _options_error(args: Options) -> str | None:
    if args.sweep and not (args.goodput and args.result_file):
        return "--sweep needs --goodput KEY:MS ... and --result-file"
    return options_error(args)


def run(args: Options) -> int:
    error = _options_error(args)
    if error:
        print(f"epdserve bench: error: {error}", file=sys.stderr)
        return 2
    try:
        requests, spec = workload.build_from_args(args)
        args = with_values(args, ignore_eos=workload.sends_ignore_eos(args))
        if args.sweep:
            result = run_sweep(args, requests, spec)
        else:
            result = bench(args.base_url, requests, args, model=args.model, tokenizer_id=spec.get("tokenizer"))
    except (workload.TraceError, client.UnsupportedWorkload, client.ServerUnreachable) as exc:
        print(f"epdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except client.ClientError as exc:
        print(f"epdserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epdserve bench: interrupted", file=sys.stderr)
        return 130
    if args.sweep:
        print("\n".join(sweep_table(result)))
        write_json(result, args.result_file)
        png = sweep.plot(result, Path(args.result_file).with_name("goodput_vs_rate.png"))
        print(f"result written to {args.result_file}" + (f", plot to {png}" if png else ""))
        return 0
    result["workload"] = spec
    print("\n".join(summary_lines(result)))
    path = file_name(args, result)
    if path is not None:
        write_json(result, path)
        print(f"result written to {path}")
    return 0
