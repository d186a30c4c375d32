"""The workload options of ``epdserve bench``, ``compare`` and (some) ``plan``: each field is its flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from epdserve.argtypes import (Flag, field_of, given_flags, float_above, float_at_least, int_at_least, nested, parse_fraction,
                               parse_range, parse_rate, parse_size, setting)
from epdserve.bench import datasets, production
from epdserve.bench.prompts import LENGTH_DISTRIBUTIONS
from epdserve.bench.traces import TraceError

positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
positive_float = float_above(0)
nonnegative_float = float_at_least(0)

PRODUCTION_WORKLOADS = ("mooncake", "azure")
WORKLOADS = ("synthetic", "prefix", "demo", "shift", "sharegpt", *PRODUCTION_WORKLOADS)
# vLLM --dataset-name values with a generator here; its other datasets are refused.
VLLM_DATASET_NAMES = {"random": "synthetic", "prefix_repetition": "prefix"}
DATASET_FORMATS = {"sharegpt": "ShareGPT-format JSON", "mooncake": "Mooncake JSON lines",
                   "azure": "Azure LLM inference trace CSV"}


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


@dataclass(frozen=True)
class ArrivalOptions:
    """Rates in req/s."""
    request_rate: float | None = field(default=None, metadata=setting(
        "mean arrival rate in req/s, inf = all at once (default inf, demo default 0.25)", type=parse_rate,
        metavar="R"))
    burstiness: float = field(default=1.0, metadata=setting(
        "gamma shape of the gaps between arrivals: 1 = Poisson (default), <1 burstier, >1 steadier (vLLM's "
        "definition)", type=positive_float, metavar="B"))
    ramp_up_start_rps: float | None = field(default=None, metadata=setting(
        "linear ramp: rate of the first request (req/s); needs --ramp-up-end-rps, replaces --request-rate",
        type=positive_float, metavar="A"))
    ramp_up_end_rps: float | None = field(default=None, metadata=setting(
        "linear ramp: rate of the last request (req/s)", type=positive_float, metavar="B"))

    def of_trace(self, default_rate: float) -> dict:
        """Raises TraceError for a half ramp or a ramp with a rate."""
        start, end = self.ramp_up_start_rps, self.ramp_up_end_rps
        if (start is None) != (end is None):
            raise TraceError("a linear ramp needs both --ramp-up-start-rps and --ramp-up-end-rps")
        if start is not None and self.request_rate is not None:
            raise TraceError("--request-rate and --ramp-up-*-rps exclude each other "
                             "(the ramp sets the rate)")
        return {"burstiness": self.burstiness, "ramp": (start, end) if start is not None else None,
                "request_rate": self.request_rate or default_rate}


@dataclass(frozen=True)
class PrefixOptions:
    prefix_count: int = field(default=4, metadata=setting(
        "distinct prefixes (default %(default)s)", type=positive_int, metavar="K"))
    prefix_len: int = field(default=256, metadata=setting(
        "tokens per prefix (default %(default)s)", type=positive_int, metavar="P"))
    suffix_len: tuple[int, int] = field(default=(16, 64), metadata=setting(
        "tokens of each request's own suffix (default 16:64)", type=parse_range, metavar="MIN:MAX"))
    prefix_order: str = field(default="round-robin", metadata=setting(
        "which prefix request i takes (default round-robin)", choices=["round-robin", "random"]))


@dataclass(frozen=True)
class DemoOptions:
    num_long: int = field(default=datasets.DEMO_DEFAULTS["num_long"], metadata=setting(
        "long prompts (default %(default)s)", "--num-long", "--long-count", type=nonnegative_int, metavar="N"))
    long_input_len: int = field(default=datasets.DEMO_DEFAULTS["long_input_len"], metadata=setting(
        "tokens per long prompt (default %(default)s)", "--long-input-len", "--long-len", type=positive_int,
        metavar="N"))
    long_output_len: int = field(default=datasets.DEMO_DEFAULTS["long_output_len"], metadata=setting(
        "output tokens per long prompt (default %(default)s)", type=positive_int))
    long_burst: int = field(default=1, metadata=setting(
        "long prompts sent at the same instant (default 1)", type=positive_int, metavar="N"))


@dataclass(frozen=True)
class ShiftOptions:
    shift_phases: list[datasets.Phase] | None = field(default=None, metadata=setting(
        "phases back to back, ';'-separated, each in=MIN:MAX,out=MIN:MAX,rate=R,n=N (prompt and output tokens, "
        f"req/s, requests); default {datasets.SHIFT_DEFAULT.replace('%', '%%')}", type=parse_shift_phases,
        metavar="SPEC"))


@dataclass(frozen=True)
class ProductionFit:
    """How a production trace is replayed; None: not given (see :meth:`fit`)."""
    start: float | None = field(default=None, metadata=setting(
        "replay from S seconds after the trace's first arrival (default 0)", type=nonnegative_float, metavar="S"))
    duration: float | None = field(default=None, metadata=setting(
        "replay the requests arriving in the S seconds from --start (default: to the end; --num-prompts N keeps "
        "the first N)", type=positive_float, metavar="S"))
    time_scale: float | None = field(default=None, metadata=setting(
        "multiply every arrival offset by F: 0.1 replays 10 minutes of trace in 1, 2 at half speed (default 1)",
        type=positive_float, metavar="F"))
    length_scale: float | None = field(default=None, metadata=setting(
        "multiply input and output token lengths by F, rounded, at least 1 (a Mooncake block of 512 tokens "
        "becomes round(512*F)) (default 1)", type=positive_float, metavar="F"))
    max_input_len: int | None = field(default=None, metadata=setting(
        "cap prompt tokens after scaling (a capped prompt keeps its first blocks; default no cap)",
        type=positive_int, metavar="N"))
    max_output_len: int | None = field(default=None, metadata=setting(
        "cap output tokens after scaling (default no cap)", type=positive_int, metavar="N"))

    def given(self) -> list[str]:
        return given_flags(self)

    def fit(self, num_prompts: int | None) -> production.Fit:
        """Not given: start 0, to the end, all requests, scales 1, no caps."""
        given = {"start_s": self.start, "duration_s": self.duration, "num_prompts": num_prompts,
                 "time_scale": self.time_scale, "length_scale": self.length_scale,
                 "max_input_len": self.max_input_len, "max_output_len": self.max_output_len}
        return production.Fit(**{k: v for k, v in given.items() if v is not None})


PRODUCTION_TITLE = "production traces (--workload mooncake|azure)"


def _workload_field(default: str):
    return field(default=default, metadata=setting(
        f"trace generator (default {default}); sharegpt, mooncake and azure need --dataset-path; --dataset-name "
        f"is vLLM's name for it, which also takes vLLM's "
        + ", ".join(f"{k} (= {v})" for k, v in VLLM_DATASET_NAMES.items()),
        "--workload", "--dataset-name", type=parse_workload, metavar="{" + ",".join(WORKLOADS) + "}"))


@dataclass(frozen=True)
class WorkloadOptions:
    """bench's; lengths are token ``(MIN, MAX)``."""
    workload: str = _workload_field("synthetic")
    num_prompts: int | None = field(default=None, metadata=setting(
        "requests (default 50), chat requests (demo, default 24), or the first N requests of the window "
        "(mooncake, azure; default all)", type=positive_int))
    input_len: tuple[int, int] | None = field_of(INPUT_LEN_FLAG)
    output_len: tuple[int, int] | None = field_of(OUTPUT_LEN_FLAG)
    length_dist: str = field(default="uniform", metadata=setting(
        "distribution of lengths over their MIN:MAX range: uniform (default), normal (mean mid-range, std "
        "range/6) or lognormal (median sqrt(MIN*MAX)), clipped to the range", choices=LENGTH_DISTRIBUTIONS))
    arrivals: ArrivalOptions = nested(ArrivalOptions, "arrivals")
    prefixes: PrefixOptions = nested(PrefixOptions, "shared prefixes (--workload prefix)")
    demo: DemoOptions = nested(DemoOptions, "long-prompt bursts (--workload demo)")
    shift: ShiftOptions = nested(ShiftOptions, "phases (--workload shift)")
    production: ProductionFit = nested(ProductionFit, PRODUCTION_TITLE)
    dataset_path: str | None = field(default=None, metadata=setting(
        "dataset file: " + "; ".join(f"{v} (--workload {k})" for k, v in DATASET_FORMATS.items()),
        metavar="FILE"))
    images_per_request: int = field_of(IMAGE_FLAGS[0])
    image_size: tuple[int, int] = field_of(IMAGE_FLAGS[1])
    image_repeat_share: float = field_of(IMAGE_FLAGS[2])
    seed: int = field_of(SEED_FLAG)
    tokenizer: str | None = field(default=None, metadata=setting(
        "model directory or GGUF whose tokenizer sizes the prompts (default: the default model)", metavar="PATH"))
    trace: str | None = field(default=None, metadata=setting(
        "replay this JSON-lines trace instead of generating one", metavar="FILE"))
    save_trace: str | None = field(default=None, metadata=setting(
        "write the trace used to FILE (JSON lines)", metavar="FILE"))


@dataclass(frozen=True)
class DemoWorkloadOptions(WorkloadOptions):
    """compare's: the demo workload by default."""
    workload: str = _workload_field("demo")
