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
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from epdserve.argtypes import Flag, add_flags, field_of, float_above, float_at_least, nested, setting, slo_pair
from epdserve.bench import client, metrics, sweep, workload
from epdserve.bench.result_file import RESULT_TITLE, ResultOptions, file_name, options_error
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


GOODPUT_TARGET_FLAG = Flag("--goodput-target", type=parse_share, default=0.9, metavar="F",
                           help="share of requests that must meet every SLO (default 0.9)")


@dataclass(frozen=True)
class ClientOptions:
    """bench's: vLLM's ``--ignore-eos``."""
    endpoint: str = field(default="chat", metadata=setting(
        "POST /v1/chat/completions (chat, the default) or /v1/completions (completions); vLLM's path form is "
        "taken too", type=endpoint_arg, metavar="chat|completions|PATH"))
    temperature: float = field(default=0.0, metadata=setting("sampling temperature (default 0)",
                                                             type=float_at_least(0)))
    ignore_eos: bool = field(default=False, metadata=setting(
        "send ignore_eos, so output lengths are as asked (as vLLM, always on for the synthetic (random), demo, "
        "mooncake and azure workloads and a --trace replay; off by default for prefix and sharegpt)",
        action="store_true"))
    goodput: list[tuple[str, float]] | None = field(default=None, metadata=setting(
        "SLOs for goodput in ms, e.g. ttft:2000 tpot:200 itl:1000: ttft, tpot (the request's mean gap, as vLLM), "
        "e2el, itl (the request's longest inter-token gap: a stall fails it, the mean hides it), itl_p99 (its "
        "p99 gap); compare judges by " + " ".join(f"{k}:{v:g}" for k, v in metrics.DEFAULT_SLOS_MS.items())
        + " when none are given", nargs="+", type=parse_goodput, metavar="KEY:MS"))
    request_timeout: float = field(default=600.0, metadata=setting(
        "per-read timeout of a request in seconds (default 600)", type=float_above(0), metavar="S"))
    warmup: int = field(default=1, metadata=setting(
        "short unmeasured requests sent before the run (default 1)", type=workload.nonnegative_int, metavar="N"))
    warmup_requests: int = field(default=0, metadata=setting(
        "the first K requests of the trace are sent as scheduled but left out of the results (default 0)",
        type=workload.nonnegative_int, metavar="K"))
    max_concurrency: int | None = field(default=None, metadata=setting(
        "at most C requests in flight; later ones wait for a slot (with --request-rate inf: a closed loop of C "
        "clients)", type=workload.positive_int, metavar="C"))
    disable_tqdm: bool = field(default=False, metadata=setting("no progress bar", action="store_true"))


@dataclass(frozen=True)
class ReplayClientOptions(ClientOptions):
    """compare's: ``ignore_eos`` unless ``--no-ignore-eos``, so every deployment generates the trace's output
    lengths."""
    ignore_eos: bool = field(default=True, metadata=setting(
        "let the model stop at EOS (default: ignore_eos=true, so every deployment generates the trace's output "
        "lengths)", "--no-ignore-eos", dest="ignore_eos", action="store_false"))


@dataclass(frozen=True)
class SweepOptions:
    sweep: bool = field(default=False, metadata=setting(
        "find the highest request rate meeting --goodput for a share --goodput-target of requests (bisection on "
        "rate)", action="store_true"))
    goodput_target: float = field_of(GOODPUT_TARGET_FLAG)
    sweep_rates: tuple[float, float] = field(default=(0.25, 4.0), metadata=setting(
        "request rates (req/s) bracketing the search (default 0.25:4)", type=parse_rates, metavar="LO:HI"))
    sweep_iters: int = field(default=4, metadata=setting(
        "bisection steps after LO and HI (default 4)", type=workload.nonnegative_int, metavar="N"))


@dataclass(frozen=True)
class BenchOptions:
    base_url: str = field(default=None, metadata=setting("server URL, e.g. http://127.0.0.1:8000",
                                                         required=True, type=parse_base_url))
    model: str | None = field(default=None, metadata=setting(
        "model name sent in requests (default: first id of GET /v1/models)"))
    workload: workload.WorkloadOptions = nested(workload.WorkloadOptions, "workload")
    client: ClientOptions = nested(ClientOptions, "client")
    result: ResultOptions = nested(ResultOptions, RESULT_TITLE)
    rate_sweep: SweepOptions = nested(SweepOptions, "goodput sweep")


OPTIONS = BenchOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, BenchOptions)


def _rate_field(rate: float | None, requests: list[workload.Request]) -> float | str:
    """vLLM's ``request_rate``: the asked rate, "inf", or without one the trace's mean rate."""
    if rate is None:
        span = max(r.offset_s for r in requests) - min(r.offset_s for r in requests)
        rate = (len(requests) - 1) / span if span > 0 else math.inf
    return "inf" if math.isinf(rate) else rate


def bench(base_url: str, requests: list[workload.Request], options: ClientOptions,
          model: str | None = None, request_rate: float | None = None,
          on_start: Callable[[], None] | None = None, tokenizer_id: str | None = None,
          arrivals: workload.ArrivalOptions | None = None, result_options: ResultOptions | None = None) -> dict:
    """The result dict: metrics over all but the first ``options.warmup_requests`` requests, and
    the run's settings under vLLM's names; ``on_start`` runs after the warm-up. Without ``result_options``
    (compare): every percentile metric at :data:`metrics.PERCENTILES`.

    Raises client.ClientError (no answer, failed warm-up, unsendable trace), and TraceError when
    ``--warmup-requests`` leaves nothing to measure."""
    skip = options.warmup_requests
    if skip >= len(requests):
        raise workload.TraceError(f"--warmup-requests {skip}: the trace has only "
                                  f"{len(requests)} requests, none would be measured")
    concurrency = options.max_concurrency
    arrivals = arrivals or workload.ArrivalOptions()

    async def go() -> tuple[str, list[client.RequestRecord]]:
        name = model
        if name is None:
            async with client.make_client(1) as c:
                name = await client.fetch_model_name(c, base_url)
        records = await client.run_trace(
            base_url, name, requests, endpoint=options.endpoint, temperature=options.temperature,
            ignore_eos=options.ignore_eos, progress=not options.disable_tqdm,
            timeout_s=options.request_timeout, warmup=options.warmup, max_concurrency=concurrency,
            on_start=on_start)
        return name, records

    client.check_sendable(requests, options.endpoint)  # before any connection: the trace's fault
    name, records = asyncio.run(go())
    ramp = (arrivals.ramp_up_start_rps, arrivals.ramp_up_end_rps)
    backend = "openai-chat" if options.endpoint == "chat" else "openai"
    kept = result_options or ResultOptions(percentile_metrics=metrics.PERCENTILE_METRICS,
                                           metric_percentiles=metrics.PERCENTILES)
    # vLLM's order: setup, metadata, traffic, then the metrics.
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
              "label": kept.label, "model_id": name, "tokenizer_id": tokenizer_id,
              "num_prompts": len(requests) - skip, **dict(kept.metadata or ()),
              "request_rate": _rate_field(request_rate or arrivals.request_rate, requests),
              "burstiness": arrivals.burstiness, "max_concurrency": concurrency}
    if ramp[0] is not None and request_rate is None:
        result.update(ramp_up_strategy="linear", ramp_up_start_rps=ramp[0],
                      ramp_up_end_rps=ramp[1])
    result.update(base_url=base_url, endpoint=options.endpoint, temperature=options.temperature,
                  ignore_eos=options.ignore_eos, read_timeout=options.request_timeout, warmup_requests=skip)
    result.update(metrics.compute(records[skip:], dict(options.goodput) if options.goodput else None,
                                  kept.metric_percentiles, kept.percentile_metrics))
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


def run_sweep(options: BenchOptions, requests: list[workload.Request], spec: dict) -> dict:
    sweeping = options.rate_sweep

    def measure(rate: float) -> dict:
        return bench(options.base_url, retime(requests, rate, options.workload.seed), options.client,
                     model=options.model, request_rate=rate, arrivals=options.workload.arrivals,
                     result_options=options.result)

    lo, hi = sweeping.sweep_rates
    result = sweep.find_max_goodput_rate(measure, sweeping.goodput_target, lo, hi,
                                         sweeping.sweep_iters, progress=not options.client.disable_tqdm)
    result.update(goodput_slos_ms=dict(options.client.goodput), workload=spec,
                  sweep_rates=[lo, hi], sweep_iters=sweeping.sweep_iters)
    return result


def _options_error(options: BenchOptions) -> str | None:
    if options.rate_sweep.sweep and not (options.client.goodput and options.result.result_file):
        return "--sweep needs --goodput KEY:MS ... and --result-file"
    return options_error(options.result)


def run(options: BenchOptions) -> int:
    error = _options_error(options)
    if error:
        print(f"epdserve bench: error: {error}", file=sys.stderr)
        return 2
    try:
        requests, spec = workload.build_from_args(options.workload)
        options = replace(options, client=replace(
            options.client, ignore_eos=workload.sends_ignore_eos(options.workload, options.client.ignore_eos)))
        if options.rate_sweep.sweep:
            result = run_sweep(options, requests, spec)
        else:
            result = bench(options.base_url, requests, options.client, model=options.model,
                           tokenizer_id=spec.get("tokenizer"), arrivals=options.workload.arrivals,
                           result_options=options.result)
    except (workload.TraceError, client.UnsupportedWorkload, client.ServerUnreachable) as exc:
        print(f"epdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except client.ClientError as exc:
        print(f"epdserve bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epdserve bench: interrupted", file=sys.stderr)
        return 130
    result_file = options.result.result_file
    if options.rate_sweep.sweep:
        print("\n".join(sweep_table(result)))
        write_json(result, result_file)
        png = sweep.plot(result, Path(result_file).with_name("goodput_vs_rate.png"))
        print(f"result written to {result_file}" + (f", plot to {png}" if png else ""))
        return 0
    result["workload"] = spec
    print("\n".join(summary_lines(result)))
    path = file_name(options.result, result, options.workload.arrivals.request_rate)
    if path is not None:
        write_json(result, path)
        print(f"result written to {path}")
    return 0
