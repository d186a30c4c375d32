"""The result file of ``epdserve bench`` as ``vllm bench serve`` writes it
(``vllm/benchmarks/serve.py``): options, checks and file name (docs/benchmarks.md). Unlike vLLM,
an option that would do nothing is an error."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.argtypes import setting
from epdserve.bench import metrics

DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vLLM's, for generative models
DEFAULT_METRIC_PERCENTILES = (99.0,)
SETTING_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                "request_rate", "burstiness", "max_concurrency", "ramp_up_strategy", "ramp_up_start_rps",
                "ramp_up_end_rps", "base_url", "endpoint", "temperature", "ignore_eos", "read_timeout",
                "warmup_requests", "workload", "goodput_slos_ms")


def parse_metadata(text: str) -> tuple[str, str]:
    """argparse type: vLLM's ``--metadata KEY=VALUE``, stripped, KEY not empty."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. version=0.3.3")
    return key.strip(), value.strip()


def parse_percentiles(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated percentiles in (0, 100]."""
    out = []
    for part in text.split(","):
        try:
            p = float(part)
        except ValueError:
            p = math.nan
        if not 0 < p <= 100:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: a percentile must be a number in (0, 100]")
        out.append(p)
    return tuple(out)


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """argparse type: names of :data:`~epdserve.bench.metrics.PERCENTILE_METRICS`
    (vLLM's client_queue_time and e2el_including_client_queue are refused)."""
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if name not in metrics.PERCENTILE_METRICS:
            raise argparse.ArgumentTypeError(f"{name!r} in {text!r}: expected metrics among "
                                             f"{', '.join(metrics.PERCENTILE_METRICS)}")
    return names


@dataclass(frozen=True)
class ResultOptions:
    label: str | None = field(default=None, metadata=setting(
        "the result's label and the file name's prefix (default: the backend, openai-chat or openai)"))
    metadata: list[tuple[str, str]] | None = field(default=None, metadata=setting(
        "fields stored in the result, e.g. --metadata version=0.3.3 tp=1", nargs="+", type=parse_metadata,
        metavar="KEY=VALUE"))
    percentile_metrics: tuple[str, ...] = field(default=DEFAULT_PERCENTILE_METRICS, metadata=setting(
        "metrics with mean, median, std and percentiles in the result: ttft, tpot, itl, e2el (default "
        "ttft,tpot,itl)", type=parse_percentile_metrics, metavar="M,..."))
    metric_percentiles: tuple[float, ...] = field(default=DEFAULT_METRIC_PERCENTILES, metadata=setting(
        "their percentiles, e.g. 25,50,99 (default 99)", type=parse_percentiles, metavar="P,..."))
    save_result: bool = field(default=False, metadata=setting(
        "write the result JSON to {label}-{rate}qps[-concurrency{C}]-{model}-{date}.json", action="store_true"))
    result_dir: str | None = field(default=None, metadata=setting(
        "with --save-result: the directory of the file (default: the current one)", metavar="DIR"))
    result_filename: str | None = field(default=None, metadata=setting(
        "with --save-result: the file's name instead of the pattern", metavar="NAME"))
    result_file: str | None = field(default=None, metadata=setting(
        "write the result JSON to FILE (default: not written; --sweep needs it or --save-result)",
        metavar="FILE"))


RESULT_TITLE = "result file (as vllm bench serve)"


def options_error(args: ResultOptions) -> str | None:
    if not args.save_result:
        lonely = [flag for flag, value in (("--result-dir", args.result_dir),
                                           ("--result-filename", args.result_filename)) if value]
        if lonely:
            return f"{' and '.join(lonely)} need --save-result"
    elif args.result_file:
        return "--save-result and --result-file exclude each other (--result-dir/--result-filename name the file)"
    keys = [k for k, _ in args.metadata or ()]
    taken = set(SETTING_KEYS) | set(metrics.compute([], {"ttft": 1.0}, args.metric_percentiles,
                                                    args.percentile_metrics))
    for key in keys:
        if key in taken:
            return f"--metadata {key}=...: {key!r} is a field of the result"
    if len(set(keys)) < len(keys):
        return f"--metadata: a key given twice ({', '.join(sorted({k for k in keys if keys.count(k) > 1}))})"
    return None


def file_name(args: ResultOptions, result: dict, request_rate: float | None = None) -> Path | None:
    """``--result-file``, else with ``--save-result`` vLLM's name (or ``--result-filename``) in
    ``--result-dir``; ``request_rate``: ``--request-rate``; None: not written."""
    if args.result_file:
        return Path(args.result_file)
    if not args.save_result:
        return None
    concurrency = f"-concurrency{result['max_concurrency']}" if result.get("max_concurrency") is not None else ""
    label = result.get("label") or result["backend"]
    model = str(result["model_id"]).split("/")[-1]
    if result.get("ramp_up_strategy"):
        rates = (f"ramp-up-{result['ramp_up_strategy']}-{result['ramp_up_start_rps']}qps-"
                 f"{result['ramp_up_end_rps']}qps")
    else:
        rates = f"{_rate_word(request_rate, result['request_rate'])}qps"
    name = args.result_filename or f"{label}-{rates}{concurrency}-{model}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def _rate_word(asked: float | None, measured: float | str) -> str:
    """The asked rate as vLLM prints it (``inf``, ``2.0``), else the trace's to 4 digits."""
    if asked is not None:
        return "inf" if math.isinf(asked) else str(float(asked))
    return measured if isinstance(measured, str) else f"{measured:.4g}"
