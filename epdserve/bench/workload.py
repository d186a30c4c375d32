"""The trace ``epdserve bench`` and ``compare`` ask for (their options: ``workload_options``); the same
options and tokenizer give the same trace, byte for byte."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict

from epdserve.bench import datasets, production
from epdserve.bench.production_formats import read_production
from epdserve.bench.prompts import load_tokenizer_for
from epdserve.bench.traces import Request, TraceError, load_trace, save_trace
# ArrivalOptions, DemoWorkloadOptions, nonnegative_int, parse_shift_phases, positive_int: also read from here.
from epdserve.bench.workload_options import (DATASET_FORMATS, PRODUCTION_WORKLOADS, ArrivalOptions,  # noqa: F401
                                             DemoWorkloadOptions, WorkloadOptions, nonnegative_int,
                                             parse_shift_phases, positive_int)
from epdserve.model.loader import resolve_model

# Sent with ignore_eos as vLLM does for its random datasets and timed traces.
IGNORE_EOS_WORKLOADS = ("synthetic", "demo", "shift", *PRODUCTION_WORKLOADS)


def sends_ignore_eos(options: WorkloadOptions, ignore_eos: bool = False) -> bool:
    """``ignore_eos`` (``--ignore-eos``), or a workload whose output lengths are measured (vLLM sets it for
    its random datasets and timed traces)."""
    return bool(ignore_eos or options.trace or options.workload in IGNORE_EOS_WORKLOADS)


def build_from_args(options: WorkloadOptions, tokenizer_path: str | None = None
                    ) -> tuple[list[Request], dict]:
    """(trace, how it was made); saved when ``--save-trace`` is given.

    Raises TraceError naming the bad trace, dataset file or setting."""
    _check_options(options)
    tokenizer = options.tokenizer or tokenizer_path
    if options.trace:
        requests = load_trace(options.trace)
        spec = {"source": "trace", "trace": str(options.trace)}
    elif options.workload in PRODUCTION_WORKLOADS:
        tok = load_tokenizer_for(tokenizer)
        requests, spec = production_requests(options, tok)
        _print_replay(spec)
        requests = _add_images(requests, options, spec)
        spec = {**{k: _jsonable(v) for k, v in spec.items()}, "tokenizer": tok.name_or_path}
    else:
        tok = load_tokenizer_for(tokenizer)
        requests, params, extra = _generate(options, tok, tokenizer)
        requests = _add_images(requests, options, params)
        spec = {"source": options.workload, **{k: _jsonable(v) for k, v in params.items()}, **extra,
                "tokenizer": tok.name_or_path}
    if options.save_trace:
        save_trace(requests, options.save_trace)
    return requests, spec


def _check_options(options: WorkloadOptions) -> None:
    """Raises TraceError for options the workload does not take."""
    workload, arrivals = options.workload, options.arrivals
    if options.dataset_path and workload not in DATASET_FORMATS:
        raise TraceError(f"--dataset-path is for --workload {'|'.join(DATASET_FORMATS)}, "
                         f"not {workload}")
    production_only = options.production.given()
    if production_only and workload not in PRODUCTION_WORKLOADS:
        raise TraceError(f"{', '.join(production_only)}: for --workload "
                         f"{'|'.join(PRODUCTION_WORKLOADS)} only, not {workload}")
    if options.shift.shift_phases is not None and workload != "shift":
        raise TraceError(f"--shift-phases is for --workload shift, not {workload}")
    generator_only = [flag for flag, value in (
        ("--input-len", options.input_len), ("--output-len", options.output_len),
        ("--request-rate", arrivals.request_rate), ("--ramp-up-start-rps", arrivals.ramp_up_start_rps),
        ("--ramp-up-end-rps", arrivals.ramp_up_end_rps)) if value is not None]
    per_phase = generator_only + (["--num-prompts"] if options.num_prompts is not None else [])
    if per_phase and workload == "shift":
        raise TraceError(f"{', '.join(per_phase)}: --workload shift sets lengths, rates and "
                         f"counts per phase in --shift-phases")
    if generator_only and workload in PRODUCTION_WORKLOADS:
        raise TraceError(f"{', '.join(generator_only)}: --workload {workload} takes "
                         f"arrivals and lengths from the trace; fit them with --time-scale, "
                         f"--length-scale, --max-input-len and --max-output-len")


def production_requests(options: WorkloadOptions, tokenizer) -> tuple[list[Request], dict]:
    """Requests replaying ``--dataset-path``; ``tokenizer`` None gives the planner's
    stand-in prompts. Raises TraceError: no file, a bad file, an empty window, unbuildable prompts."""
    if not options.dataset_path:
        raise TraceError(f"--workload {options.workload} needs --dataset-path FILE "
                         f"({DATASET_FORMATS[options.workload]})")
    fit = options.production.fit(options.num_prompts)
    trace = read_production(options.dataset_path, options.workload)
    requests, report = production.replay_trace(trace, fit, tokenizer, options.seed)
    spec = {"source": options.workload, "dataset_path": str(options.dataset_path), **asdict(fit),
            "block_tokens": fit.block_tokens, "seed": options.seed, "replay": report}
    return requests, spec


def _print_replay(spec: dict) -> None:
    report = spec["replay"]
    print(f"trace {spec['dataset_path']} ({spec['source']}): {report['replayed']['count']} of "
          f"{report['original']['count']} requests replayed", file=sys.stderr)
    print("\n".join(production.replay_lines(report)), file=sys.stderr)


def _generate(options: WorkloadOptions, tok, model: str | None) -> tuple[list[Request], dict, dict]:
    """(requests, params, extra); ``model``'s window must fit every shift phase."""
    dist = options.length_dist
    if options.workload == "shift":
        phases = options.shift.shift_phases or datasets.parse_phases(datasets.SHIFT_DEFAULT)
        datasets.check_window(phases, resolve_model(model).max_model_len)
        params = dict(seed=options.seed, length_dist=dist, burstiness=options.arrivals.burstiness)
        requests, windows = datasets.shift(tok, phases, **params)
        return requests, {**params, "phases": datasets.format_phases(phases)}, {"phase_windows": windows}
    if options.workload == "demo":
        params = _demo_params(options)
        return datasets.demo(tok, **params), params, {}
    if options.workload == "sharegpt":
        return _sharegpt(options, tok)
    params = dict(num_prompts=options.num_prompts or 50, output_len=options.output_len or (64, 128),
                  seed=options.seed, length_dist=dist, **options.arrivals.of_trace(float("inf")))
    if options.workload == "prefix":
        p = options.prefixes
        params.update(prefix_count=p.prefix_count, prefix_len=p.prefix_len, suffix_len=p.suffix_len,
                      order=p.prefix_order)
        return datasets.shared_prefix(tok, **params), params, {}
    params["input_len"] = options.input_len or (100, 400)
    return datasets.synthetic(tok, **params), params, {}


def _demo_params(options: WorkloadOptions) -> dict:
    d, demo = datasets.DEMO_DEFAULTS, options.demo
    params = dict(num_chat=options.num_prompts or d["num_chat"],
                  chat_input_len=options.input_len or d["chat_input_len"],
                  chat_output_len=options.output_len or d["chat_output_len"],
                  num_long=demo.num_long, long_input_len=demo.long_input_len,
                  long_output_len=demo.long_output_len, long_burst=demo.long_burst, seed=options.seed,
                  length_dist=options.length_dist, **options.arrivals.of_trace(d["chat_rate"]))
    params["chat_rate"] = params.pop("request_rate")
    return params


def _sharegpt(options: WorkloadOptions, tok) -> tuple[list[Request], dict, dict]:
    if not options.dataset_path:
        raise TraceError("--workload sharegpt needs --dataset-path FILE")
    params = dict(path=options.dataset_path, num_prompts=options.num_prompts or 50,
                  output_len=options.output_len, seed=options.seed,
                  **options.arrivals.of_trace(float("inf")))
    requests, extra = datasets.sharegpt(tok, **params)
    print(f"dataset {options.dataset_path}: {extra['used']} of {extra['conversations']} "
          f"conversations used; skipped {extra['skipped_no_answer']} without an "
          f"answer, {extra['skipped_too_short']} too short, "
          f"{extra['skipped_too_long']} too long", file=sys.stderr)
    return requests, params, extra


def _add_images(requests: list[Request], options: WorkloadOptions, params: dict) -> list[Request]:
    images, repeat = options.images_per_request, options.image_repeat_share
    if not images:
        return requests
    params.update(images_per_request=images, image_size=options.image_size, image_repeat_share=repeat)
    return datasets.with_images(requests, images, options.image_size, repeat, options.seed)


def _jsonable(value):
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    return value
