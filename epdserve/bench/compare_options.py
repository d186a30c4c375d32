"""``epdserve compare``'s options: each field is its flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from epdserve.argtypes import Flag, field_of, float_above, nested, setting
from epdserve.bench import rounds, slo_map, workload
from epdserve.bench.run import GOODPUT_TARGET_FLAG, ReplayClientOptions, parse_rates
from epdserve.serving import flags
from epdserve.serving.deployment import NAME_HELP, DeploymentSpec


def parse_configs(text: str) -> list[str]:
    """argparse type: comma-separated unique deployment names, in canonical form."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: no configuration named; {NAME_HELP}")
    try:
        names = [DeploymentSpec.parse(n).name for n in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
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


CONFIGS_FLAG = Flag(
    "--configs", type=parse_configs, default=None, metavar="NAMES",
    help="epdserve deployments by name, in order: colocated, colocated-chunked, colocated-N (N replicas), pd, "
         "XpYd (X prefill, Y decode workers), XeYpZd (EPD: X encode, Y prefill, Z decode workers), pd-localN, "
         "elastic (2 workers that change role live, steering by the SLOs), elastic-N (N >= 2 such workers); "
         "NAME-tpS: every engine worker S tensor-parallel ranks, NAME-tpP/D: prefill workers P, decode D (as plan "
         "names them; not elastic, colocated-chunked, pd-localN), XeYpZd-tpE/P/D: encode workers E too; NAME-noprefix: prefix caching off. compare runs them (default colocated,pd unless --deployments is "
         "given; the first is the baseline of the ratio column); plan simulates them as compare's launcher "
         "places them on the --devices, with their scheduler settings (--max-num-seqs etc. do not apply), "
         "instead of every candidate")


@dataclass(frozen=True)
class CompareSweepOptions:
    sweep_rates: tuple[float, float] | None = field(default=None, metadata=setting(
        "also find each configuration's highest request rate (req/s) within the SLOs by bisection over LO..HI, "
        "replaying the trace re-timed to each rate; draws goodput_vs_rate.png", type=parse_rates, metavar="LO:HI"))
    goodput_target: float = field_of(GOODPUT_TARGET_FLAG)
    sweep_iters: int = field(default=3, metadata=setting(
        "bisection steps after LO and HI (default 3)", type=workload.nonnegative_int, metavar="N"))


@dataclass(frozen=True)
class CompareOptions:
    workload: workload.DemoWorkloadOptions = nested(workload.DemoWorkloadOptions, "workload")
    client: ReplayClientOptions = nested(ReplayClientOptions, "client")
    configs: list[str] | None = field_of(CONFIGS_FLAG)
    deployments: list[str] | None = field(default=None, metadata=setting(
        "TOML files of [[deployment]] entries (epdserve deployments, processes to start, or base URLs of running "
        "servers; see docs/comparing.md and examples/deployments/), run after the --configs ones", nargs="+",
        metavar="FILE"))
    model: str | None = field(default=None, metadata=setting(
        "model directory or GGUF for the epdserve servers (default: the default model; vlm, the default "
        "multimodal model, when the trace has images); also sizes the prompts unless --tokenizer is given",
        metavar="PATH"))
    output: str = field(default="results/compare", metadata=setting(
        "output directory (default results/compare)", metavar="DIR"))
    port: int = field(default=8100, metadata=setting("epdserve router port on 127.0.0.1 (default 8100)",
                                                     type=_port))
    startup_timeout: float = field(default=300.0, metadata=setting(
        "seconds to wait for an epdserve deployment's /health == 200 (default 300)", type=float_above(0),
        metavar="S"))
    allow_oversubscription: bool = field_of(flags.ALLOW_OVERSUBSCRIPTION_FLAG)
    repeats: int | str = field(default=rounds.AUTO, metadata=setting(
        "run every deployment N times, interleaved (A B A B ...: drift of the machine hits each alike); the "
        "report gives each figure's median and range. auto (the default): rounds until the paired interval of the "
        "goodput difference tells the configurations apart or shows a tie, or until --budget",
        type=rounds.parse_repeats, metavar="N|auto"))
    budget: float | None = field(default=None, metadata=setting(
        "with --repeats auto: start no round that would end after MIN minutes (the first always runs; default "
        f"{rounds.DEFAULT_BUDGET_MIN:g})", type=float_above(0), metavar="MIN"))
    slo_grid: list | None = field_of(slo_map.SLO_GRID_FLAG)
    rate_sweep: CompareSweepOptions = nested(CompareSweepOptions, "goodput sweep (needs --goodput)")

    @property
    def slos(self) -> dict[str, float] | None:
        """``--goodput`` (ms) or None; elastic deployments steer by it."""
        return dict(self.client.goodput) if self.client.goodput else None
