"""Workload options of ``epdserve bench`` and ``compare`` and the trace they ask for; the same
options and tokenizer give the same trace, byte for byte."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict

from epdserve.argtypes import (Flag, Options, float_above, float_at_least, int_at_least, parse_fraction, parse_range,
                               parse_rate, parse_size)
from epdserve.bench import datasets, production
from epdserve.bench.production_formats import read_production
from epdserve.bench.prompts import LENGTH_DISTRIBUTIONS, load_tokenizer_for
from epdserve.bench.traces import Request, TraceError, load_trace, save_trace
from epdserve.model.loader import resolve_model


def parse_shift_phases(text: str) -> list[datasets.Phase]:
    try:
        return datasets.parse_phases(text)
    except TraceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_workload(text: str) -> str:
    """argparse type: a workload, or a vLLM dataset name of :data:`VLLM_DATASET_NAMES`."""
    if text in WORKLOADS:
        return text
    if text in VLLM_DATASET_NAMES:
        return VLLM_DATASET_NAMES[text]
    raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(WORKLOADS)} (or vLLM's "
                                     f"{', '.join(VLLM_DATASET_NAMES)})")


def sends_ignore_eos(args: Options) -> bool:
    """``--ignore-eos``, or a workload whose output lengths are measured (vLLM sets it for
    its random datasets and timed traces)."""
    return bool(getattr(args, "ignore_eos", False) or args.trace or args.workload in IGNORE_EOS_WORKLOADS)


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
positive_float = float_above(0)
nonnegative_float = float_at_least(0)


PRODUCTION_WORKLOADS = ("mooncake", "azure")
WORKLOADS = ("synthetic", "prefix", "demo", "shift", "sharegpt", *PRODUCTION_WORKLOADS)
# vLLM --dataset-name values with a generator here; its other datasets are refused.
VLLM_DATASET_NAMES = {"random": "synthetic", "prefix_repetition": "prefix"}
# Sent with ignore_eos as vLLM does for its random datasets and timed traces.
IGNORE_EOS_WORKLOADS = ("synthetic", "demo", "shift", *PRODUCTION_WORKLOADS)
DATASET_FORMATS = {"sharegpt": "ShareGPT-format JSON", "mooncake": "Mooncake JSON lines",
                   "azure": "Azure LLM inference trace CSV"}
PRODUCTION_OPTIONS = (("--start", "start"), ("--duration", "duration"),
                      ("--time-scale", "time_scale"), ("--length-scale", "length_scale"),
                      ("--max-input-len", "max_input_len"), ("--max-output-len", "max_output_len"))
# Options a production trace replaces with its own arrivals and lengths.
TRACE_SET_OPTIONS = (("--input-len", "input_len"), ("--output-len", "output_len"),
                     ("--request-rate", "request_rate"),
                     ("--ramp-up-start-rps", "ramp_up_start_rps"),
                     ("--ramp-up-end-rps", "ramp_up_end_rps"))


# Flags plan takes too.
INPUT_LEN_FLAG = Flag("--input-len", type=parse_range, default=None, metavar="MIN:MAX",
                      help="prompt tokens, MIN:MAX or N (default: synthetic and plan 100:400, demo 50:250; "
                           "plan: not with --trace)")
OUTPUT_LEN_FLAG = Flag("--output-len", type=parse_range, default=None, metavar="MIN:MAX",
                       help="output tokens, MIN:MAX or N (default: synthetic 64:128, demo 32:64, plan 32:128; "
                            "sharegpt: the answer's length unless given; plan: not with --trace)")
IMAGE_FLAGS = (
    Flag("--images-per-request", type=nonnegative_int, default=0, metavar="N",
         help="images attached to every request (default 0; needs a vision-language model, e.g. --model vlm, "
              "and bench's --endpoint chat; plan: also SmolVLM-256M, and adds EPD candidates)"),
    Flag("--image-size", type=parse_size, default=(448, 448), metavar="WxH",
         help="pixel size of those images (default 448x448)"),
    Flag("--image-repeat-share", type=parse_fraction, default=0.0, metavar="F",
         help="share of requests that send the same images as an earlier request (embedding cache hits; "
              "default 0: every image distinct)"),
)
SEED_FLAG = Flag("--seed", type=int, default=0,
                 help="random seed of the generated trace: lengths, images and arrivals (plan: also of the "
                      "arrivals of a trace sent all at once, re-timed to each rate; default 0)")

def add_workload_arguments(parser: argparse.ArgumentParser, default: str = "synthetic") -> None:
    g = parser.add_argument_group("workload")
    _add_generator_arguments(g, default)
    _add_arrival_arguments(parser.add_argument_group("arrivals"))
    _add_prefix_arguments(parser.add_argument_group("shared prefixes (--workload prefix)"))
    _add_demo_arguments(parser.add_argument_group("long-prompt bursts (--workload demo)"))
    parser.add_argument_group("phases (--workload shift)").add_argument(
        "--shift-phases", type=parse_shift_phases, default=None, metavar="SPEC",
        help="phases back to back, ';'-separated, each in=MIN:MAX,out=MIN:MAX,rate=R,n=N "
             "(prompt and output tokens, req/s, requests); default "
             f"{datasets.SHIFT_DEFAULT.replace('%', '%%')}")
    add_production_arguments(parser)
    _add_source_arguments(g)


def _add_generator_arguments(g, default: str) -> None:
    g.add_argument("--workload", "--dataset-name", dest="workload", type=parse_workload, default=default,
                   metavar="{" + ",".join(WORKLOADS) + "}",
                   help=f"trace generator (default {default}); sharegpt, mooncake and azure "
                        f"need --dataset-path; --dataset-name is vLLM's name for it, which also "
                        f"takes vLLM's " + ", ".join(f"{k} (= {v})" for k, v in VLLM_DATASET_NAMES.items()))
    g.add_argument("--num-prompts", type=positive_int, default=None,
                   help="requests (default 50), chat requests (demo, default 24), or the "
                        "first N requests of the window (mooncake, azure; default all)")
    INPUT_LEN_FLAG.add(g)
    OUTPUT_LEN_FLAG.add(g)
    g.add_argument("--length-dist", choices=LENGTH_DISTRIBUTIONS, default="uniform",
                   help="distribution of lengths over their MIN:MAX range: uniform (default), "
                        "normal (mean mid-range, std range/6) or lognormal (median "
                        "sqrt(MIN*MAX)), clipped to the range")


def _add_arrival_arguments(a) -> None:
    a.add_argument("--request-rate", type=parse_rate, default=None, metavar="R",
                   help="mean arrival rate in req/s, inf = all at once "
                        "(default inf, demo default 0.25)")
    a.add_argument("--burstiness", type=positive_float, default=1.0, metavar="B",
                   help="gamma shape of the gaps between arrivals: 1 = Poisson (default), "
                        "<1 burstier, >1 steadier (vLLM's definition)")
    a.add_argument("--ramp-up-start-rps", type=positive_float, default=None, metavar="A",
                   help="linear ramp: rate of the first request (req/s); needs "
                        "--ramp-up-end-rps, replaces --request-rate")
    a.add_argument("--ramp-up-end-rps", type=positive_float, default=None, metavar="B",
                   help="linear ramp: rate of the last request (req/s)")


def _add_prefix_arguments(p) -> None:
    p.add_argument("--prefix-count", type=positive_int, default=4, metavar="K",
                   help="distinct prefixes (default %(default)s)")
    p.add_argument("--prefix-len", type=positive_int, default=256, metavar="P",
                   help="tokens per prefix (default %(default)s)")
    p.add_argument("--suffix-len", type=parse_range, default=(16, 64), metavar="MIN:MAX",
                   help="tokens of each request's own suffix (default 16:64)")
    p.add_argument("--prefix-order", choices=["round-robin", "random"], default="round-robin",
                   help="which prefix request i takes (default round-robin)")


def _add_demo_arguments(d) -> None:
    d.add_argument("--num-long", "--long-count", dest="num_long", type=nonnegative_int,
                   metavar="N",
                   default=datasets.DEMO_DEFAULTS["num_long"],
                   help="long prompts (default %(default)s)")
    d.add_argument("--long-input-len", "--long-len", dest="long_input_len", type=positive_int,
                   metavar="N",
                   default=datasets.DEMO_DEFAULTS["long_input_len"],
                   help="tokens per long prompt (default %(default)s)")
    d.add_argument("--long-output-len", type=positive_int,
                   default=datasets.DEMO_DEFAULTS["long_output_len"],
                   help="output tokens per long prompt (default %(default)s)")
    d.add_argument("--long-burst", type=positive_int, default=1, metavar="N",
                   help="long prompts sent at the same instant (default 1)")


def add_production_arguments(parser: argparse.ArgumentParser) -> None:
    """Options default to None (not given: see :func:`fit_from_args`)."""
    p = parser.add_argument_group("production traces (--workload mooncake|azure)")
    p.add_argument("--start", type=nonnegative_float, default=None, metavar="S",
                   help="replay from S seconds after the trace's first arrival (default 0)")
    p.add_argument("--duration", type=positive_float, default=None, metavar="S",
                   help="replay the requests arriving in the S seconds from --start "
                        "(default: to the end; --num-prompts N keeps the first N)")
    p.add_argument("--time-scale", type=positive_float, default=None, metavar="F",
                   help="multiply every arrival offset by F: 0.1 replays 10 minutes of "
                        "trace in 1, 2 at half speed (default 1)")
    p.add_argument("--length-scale", type=positive_float, default=None, metavar="F",
                   help="multiply input and output token lengths by F, rounded, at least 1 "
                        "(a Mooncake block of 512 tokens becomes round(512*F)) (default 1)")
    p.add_argument("--max-input-len", type=positive_int, default=None, metavar="N",
                   help="cap prompt tokens after scaling (a capped prompt keeps its first "
                        "blocks; default no cap)")
    p.add_argument("--max-output-len", type=positive_int, default=None, metavar="N",
                   help="cap output tokens after scaling (default no cap)")


def _add_source_arguments(g) -> None:
    g.add_argument("--dataset-path", default=None, metavar="FILE",
                   help="dataset file: " + "; ".join(f"{v} (--workload {k})"
                                                     for k, v in DATASET_FORMATS.items()))
    for flag in (*IMAGE_FLAGS, SEED_FLAG):
        flag.add(g)
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="model directory or GGUF whose tokenizer sizes the prompts "
                        "(default: the default model)")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this JSON-lines trace instead of generating one")
    g.add_argument("--save-trace", default=None, metavar="FILE",
                   help="write the trace used to FILE (JSON lines)")


def _arrivals_from_args(args: Options, default_rate: float) -> dict:
    start = getattr(args, "ramp_up_start_rps", None)
    end = getattr(args, "ramp_up_end_rps", None)
    if (start is None) != (end is None):
        raise TraceError("a linear ramp needs both --ramp-up-start-rps and --ramp-up-end-rps")
    if start is not None and args.request_rate is not None:
        raise TraceError("--request-rate and --ramp-up-*-rps exclude each other "
                         "(the ramp sets the rate)")
    return {"burstiness": getattr(args, "burstiness", 1.0),
            "ramp": (start, end) if start is not None else None,
            "request_rate": args.request_rate or default_rate}


def build_from_args(args: Options, tokenizer_path: str | None = None
                    ) -> tuple[list[Request], dict]:
    """(trace, how it was made); saved when ``--save-trace`` is given.

    Raises TraceError naming the bad trace, dataset file or setting."""
    _check_options(args)
    if args.trace:
        requests = load_trace(args.trace)
        spec = {"source": "trace", "trace": str(args.trace)}
    elif args.workload in PRODUCTION_WORKLOADS:
        tok = load_tokenizer_for(args.tokenizer or tokenizer_path)
        requests, spec = production_requests(args, tok)
        _print_replay(spec)
        requests = _add_images(requests, args, spec)
        spec = {**{k: _jsonable(v) for k, v in spec.items()}, "tokenizer": tok.name_or_path}
    else:
        tok = load_tokenizer_for(args.tokenizer or tokenizer_path)
        requests, params, extra = _generate(args, tok, args.tokenizer or tokenizer_path)
        requests = _add_images(requests, args, params)
        spec = {"source": args.workload, **{k: _jsonable(v) for k, v in params.items()}, **extra,
                "tokenizer": tok.name_or_path}
    if args.save_trace:
        save_trace(requests, args.save_trace)
    return requests, spec


def _given(args: Options, options) -> list[str]:
    return [flag for flag, dest in options if getattr(args, dest, None) is not None]


def _check_options(args: Options) -> None:
    """Raises TraceError for options the workload does not take."""
    if getattr(args, "dataset_path", None) and args.workload not in DATASET_FORMATS:
        raise TraceError(f"--dataset-path is for --workload {'|'.join(DATASET_FORMATS)}, "
                         f"not {args.workload}")
    production_only = _given(args, PRODUCTION_OPTIONS)
    if production_only and args.workload not in PRODUCTION_WORKLOADS:
        raise TraceError(f"{', '.join(production_only)}: for --workload "
                         f"{'|'.join(PRODUCTION_WORKLOADS)} only, not {args.workload}")
    if getattr(args, "shift_phases", None) is not None and args.workload != "shift":
        raise TraceError(f"--shift-phases is for --workload shift, not {args.workload}")
    generator_only = _given(args, TRACE_SET_OPTIONS)
    per_phase = generator_only + _given(args, (("--num-prompts", "num_prompts"),))
    if per_phase and args.workload == "shift":
        raise TraceError(f"{', '.join(per_phase)}: --workload shift sets lengths, rates and "
                         f"counts per phase in --shift-phases")
    if generator_only and args.workload in PRODUCTION_WORKLOADS:
        raise TraceError(f"{', '.join(generator_only)}: --workload {args.workload} takes "
                         f"arrivals and lengths from the trace; fit them with --time-scale, "
                         f"--length-scale, --max-input-len and --max-output-len")


def fit_from_args(args: Options, num_prompts: int | None) -> production.Fit:
    """Options not given: start 0, to the end, all requests, scales 1, no caps."""
    given = {"start_s": args.start, "duration_s": args.duration,
             "num_prompts": num_prompts, "time_scale": args.time_scale,
             "length_scale": args.length_scale, "max_input_len": args.max_input_len,
             "max_output_len": args.max_output_len}
    return production.Fit(**{k: v for k, v in given.items() if v is not None})


def production_requests(args: Options, tokenizer) -> tuple[list[Request], dict]:
    """Requests replaying ``--dataset-path``; ``tokenizer`` None gives the planner's
    stand-in prompts. Raises TraceError: no file, a bad file, an empty window, unbuildable prompts."""
    if not args.dataset_path:
        raise TraceError(f"--workload {args.workload} needs --dataset-path FILE "
                         f"({DATASET_FORMATS[args.workload]})")
    fit = fit_from_args(args, args.num_prompts)
    trace = read_production(args.dataset_path, args.workload)
    requests, report = production.replay_trace(trace, fit, tokenizer, args.seed)
    spec = {"source": args.workload, "dataset_path": str(args.dataset_path), **asdict(fit),
            "block_tokens": fit.block_tokens, "seed": args.seed, "replay": report}
    return requests, spec


def _print_replay(spec: dict) -> None:
    report = spec["replay"]
    print(f"trace {spec['dataset_path']} ({spec['source']}): {report['replayed']['count']} of "
          f"{report['original']['count']} requests replayed", file=sys.stderr)
    print("\n".join(production.replay_lines(report)), file=sys.stderr)


def _generate(args: Options, tok, model: str | None) -> tuple[list[Request], dict, dict]:
    """(requests, params, extra); ``model``'s window must fit every shift phase."""
    dist = getattr(args, "length_dist", "uniform")
    if args.workload == "shift":
        phases = args.shift_phases or datasets.parse_phases(datasets.SHIFT_DEFAULT)
        datasets.check_window(phases, resolve_model(model).max_model_len)
        params = dict(seed=args.seed, length_dist=dist, burstiness=getattr(args, "burstiness", 1.0))
        requests, windows = datasets.shift(tok, phases, **params)
        return requests, {**params, "phases": datasets.format_phases(phases)}, {"phase_windows": windows}
    if args.workload == "demo":
        params = _demo_params(args, dist)
        return datasets.demo(tok, **params), params, {}
    if args.workload == "sharegpt":
        return _sharegpt(args, tok)
    params = dict(num_prompts=args.num_prompts or 50, output_len=args.output_len or (64, 128),
                  seed=args.seed, length_dist=dist, **_arrivals_from_args(args, float("inf")))
    if args.workload == "prefix":
        params.update(prefix_count=args.prefix_count, prefix_len=args.prefix_len,
                      suffix_len=args.suffix_len, order=args.prefix_order)
        return datasets.shared_prefix(tok, **params), params, {}
    params["input_len"] = args.input_len or (100, 400)
    return datasets.synthetic(tok, **params), params, {}


def _demo_params(args: Options, dist: str) -> dict:
    d = datasets.DEMO_DEFAULTS
    params = dict(num_chat=args.num_prompts or d["num_chat"],
                  chat_input_len=args.input_len or d["chat_input_len"],
                  chat_output_len=args.output_len or d["chat_output_len"],
                  num_long=args.num_long, long_input_len=args.long_input_len,
                  long_output_len=args.long_output_len,
                  long_burst=getattr(args, "long_burst", 1), seed=args.seed,
                  length_dist=dist, **_arrivals_from_args(args, d["chat_rate"]))
    params["chat_rate"] = params.pop("request_rate")
    return params


def _sharegpt(args: Options, tok) -> tuple[list[Request], dict, dict]:
    if not args.dataset_path:
        raise TraceError("--workload sharegpt needs --dataset-path FILE")
    params = dict(path=args.dataset_path, num_prompts=args.num_prompts or 50,
                  output_len=args.output_len, seed=args.seed,
                  **_arrivals_from_args(args, float("inf")))
    requests, extra = datasets.sharegpt(tok, **params)
    print(f"dataset {args.dataset_path}: {extra['used']} of {extra['conversations']} "
          f"conversations used; skipped {extra['skipped_no_answer']} without an "
          f"answer, {extra['skipped_too_short']} too short, "
          f"{extra['skipped_too_long']} too long", file=sys.stderr)
    return requests, params, extra


def _add_images(requests: list[Request], args: Options, params: dict) -> list[Request]:
    images = getattr(args, "images_per_request", 0)
    if not images:
        return requests
    repeat = getattr(args, "image_repeat_share", 0.0)
    params.update(images_per_request=images, image_size=args.image_size, image_repeat_share=repeat)
    return datasets.with_images(requests, images, args.image_size, repeat, args.seed)


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    return value
