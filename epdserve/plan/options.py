"""``epdserve plan``'s options: each field is its flag."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from epdserve.argtypes import field_of, flags_of, float_above, int_at_least, nested, setting
from epdserve.bench import metrics, slo_map
from epdserve.bench.compare_options import CONFIGS_FLAG
from epdserve.bench.run import parse_goodput
from epdserve.bench.workload_options import (IMAGE_FLAGS, INPUT_LEN_FLAG, OUTPUT_LEN_FLAG, PRODUCTION_TITLE,
                                             SEED_FLAG, ProductionFit, positive_int)
from epdserve.engine.config import EngineConfig
from epdserve.plan.at_rate import QUESTIONS
from epdserve.plan.hardware import PRECISIONS, PROFILES
from epdserve.plan.model_spec import BUILTIN
from epdserve.serving import flags

ACTIONS = ("search", "calibrate", "validate", "elastic-replay")
REPLAYS = ("steady", "once")
# Arrival seeds per deployment: each after the first costs a fifth to a third (search's hint).
DEFAULT_SEEDS = 5
# The synthetic trace planned for without --trace.
SYNTHETIC_DEFAULTS = {"input_len": (100, 400), "output_len": (32, 128), "num_requests": 300}
# The engine limits the simulated workers run with, as serve's.
_ENGINE = {flag.dest: flag for flag in flags_of(EngineConfig)}


@dataclass(frozen=True)
class PlanWorkload:
    """The workload flags plan takes: lengths are token ``(MIN, MAX)``."""
    trace: str | None = field(default=None, metadata=setting(
        "the trace to plan for, instead of --input-len etc.: a saved bench trace (JSON lines), or a Mooncake "
        "(JSON lines) or Azure (CSV) production trace, fitted by the production-trace options below "
        "(--num-requests N: its first N requests)", metavar="FILE"))
    input_len: tuple[int, int] | None = field_of(INPUT_LEN_FLAG)
    output_len: tuple[int, int] | None = field_of(OUTPUT_LEN_FLAG)
    num_requests: int | None = field(default=None, metadata=setting(
        "requests of the planned trace (default 300; not with --trace)", type=positive_int))
    images_per_request: int = field_of(IMAGE_FLAGS[0])
    image_size: tuple[int, int] = field_of(IMAGE_FLAGS[1])
    image_repeat_share: float = field_of(IMAGE_FLAGS[2])
    seed: int = field_of(SEED_FLAG)
    seeds: int | None = field(default=None, metadata=setting(
        "arrival seeds: simulate each deployment on N arrival sequences of the same requests, the Poisson arrivals "
        "of seeds --seed, --seed+1, ..., --seed+N-1, and report each figure as the median over them with its band "
        "(min-max over the seeds); a split is not picked over colocated when their goodput bands overlap "
        f"(default {DEFAULT_SEEDS}; >= 1). A --trace with arrivals of its own has one arrival sequence: it is "
        "simulated once, without a band", type=int_at_least(1), metavar="N"))
    production: ProductionFit = nested(ProductionFit, PRODUCTION_TITLE)  # fit a Mooncake or Azure --trace

    def synthetic(self) -> PlanWorkload:
        """With :data:`SYNTHETIC_DEFAULTS` where not given."""
        d = SYNTHETIC_DEFAULTS
        return replace(self, input_len=self.input_len or d["input_len"], output_len=self.output_len or d["output_len"],
                       num_requests=self.num_requests or d["num_requests"])


@dataclass(frozen=True)
class PlanOptions:
    action: str = field(default="search", metadata=setting(
        "search (default): recommend a deployment; calibrate: measure this machine; validate: predicted vs "
        "measured for a compare run; elastic-replay: the elastic controller's decisions on the signals an elastic "
        "server recorded (--elastic-trace; SLOs from --slo ttft, tpot)", "action", nargs="?", choices=ACTIONS))
    hardware: str = field(default="cpu", metadata=setting(
        f"cpu (this machine, calibrated) or one of {', '.join(PROFILES)}"))
    model: str | None = field(default=None, metadata=setting(
        f"one of {', '.join(BUILTIN)}, a model path, or vlm (the default vision-language model) (default: the "
        f"default model)"))
    precision: str = field(default="bf16", metadata=setting(
        "weights and KV precision on GPU profiles (default bf16)", choices=PRECISIONS))
    devices: int = field(default=2, metadata=setting(
        "device budget: GPUs, or cores for --hardware cpu (default 2)", type=positive_int))
    workload: PlanWorkload = nested(PlanWorkload)
    slo: list[tuple[str, float]] = field(default_factory=lambda: list(metrics.DEFAULT_SLOS_MS.items()),
                                         metadata=setting(
        "SLOs in ms, as compare's --goodput: ttft, tpot, e2el, itl (the longest gap of a request), itl_p99, e.g. "
        "ttft:300 tpot:10 itl:100 (default compare's: "
        + " ".join(f"{k}:{v:g}" for k, v in metrics.DEFAULT_SLOS_MS.items()) + ")", nargs="+", type=parse_goodput,
        metavar="KEY:MS"))
    target: float = field(default=0.9, metadata=setting(
        "capacity: share of requests that must meet every SLO (default 0.9)", type=float))
    question: str = field(default="capacity", metadata=setting(
        "capacity (default): the highest rate at which --target of the requests meet the SLOs; goodput: "
        "requests/s within the SLOs at the --trace's own arrivals, judged and mapped as `epdserve compare` judges "
        "a run (plan.md's map, slo_map.png)", choices=QUESTIONS))
    slo_grid: list | None = field_of(slo_map.SLO_GRID_FLAG)
    max_num_seqs: int = field_of(_ENGINE["max_num_seqs"])
    max_num_batched_tokens: int | None = field_of(_ENGINE["max_num_batched_tokens"])
    enable_chunked_prefill: bool = field_of(_ENGINE["enable_chunked_prefill"])
    price_per_hour: float | None = field(default=None, metadata=setting("USD per device-hour", type=float_above(0)))
    configs: list[str] | None = field_of(CONFIGS_FLAG)
    replay: str = field(default="steady", metadata=setting(
        "steady (default): at each rate, replay the trace back to back until the queue is steady and measure the "
        "steady copies; once: the trace once, as `epdserve compare --sweep-rates` sends it (optimistic for a "
        "short trace)", choices=REPLAYS))
    calibration: str | None = field(default=None, metadata=setting(
        "calibration file (default ~/.cache/epdserve/calibration/MODEL-cpu.json)", metavar="FILE"))
    compare_dir: list[str] | None = field(default=None, metadata=setting(
        "validate: `epdserve compare` outputs, several for repeats of one trace", nargs="+", metavar="DIR"))
    from_compare: list[str] | None = field(default=None, metadata=setting(
        "calibrate: fit the serving slowdown of prefill and decode steps to these `epdserve compare` outputs "
        "(same engine as the calibration) instead of measuring the engine", nargs="+", metavar="DIR"))
    rounds: int = field(default=3, metadata=setting(
        "calibrate: time every step N times and fit the medians (default 3)", type=positive_int, metavar="N"))
    output: str = field(default="results/plan", metadata=setting(None, metavar="DIR"))
    elastic_trace: str | None = field(default=None, metadata=setting(
        "elastic-replay: the --trace-file of a `serve --elastic` router", metavar="FILE"))
    timings: flags.ElasticTimings = nested(flags.ElasticTimings)
