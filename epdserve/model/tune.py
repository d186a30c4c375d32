"""``epdserve tune``: measure this machine's choices again (as a worker of each thread count and format),
replace what was kept and print them; for after a busy first start or a ``disturbed`` source in ``/health``."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch

from epdserve.argtypes import add_flags, setting
from epdserve.model import kernels, linear, step_budget
from epdserve.model.llama import LlamaModel
from epdserve.model.loader import BF16_CPU_FLAGS, ModelLoadError, resolve_model

BLOCK_FORMATS = tuple(f for f in linear.WEIGHT_FORMATS if f.startswith("q4_1"))  # the formats with a cut-over


def default_threads() -> list[int]:
    """1 (a worker per core) and all of this process's cores (a colocated worker)."""
    return sorted({1, len(os.sched_getaffinity(0))})


def default_formats() -> list[str]:
    """``q4_1+bf16`` only where the CPU computes bfloat16 natively."""
    formats = ["q4_1", "q4_1+f32"]
    return formats + (["q4_1+bf16"] if BF16_CPU_FLAGS & kernels.cpu_flags() else [])


@dataclass(frozen=True)
class TuneOptions:
    model: str | None = field(default=None, metadata=setting(
        "the model whose layers are timed (default: SmolLM2-135M-Instruct)", metavar="GGUF|DIR"))
    threads: list[int] | None = field(default=None, metadata=setting(
        "the engine thread counts to measure at, one per worker size "
        f"(default: {' '.join(map(str, default_threads()))}: one core, and all of this process's)", type=int,
        nargs="+", metavar="N"))
    weight_formats: list[str] | None = field(default=None, metadata=setting(
        f"the formats with GGUF blocks to measure, of {', '.join(BLOCK_FORMATS)} "
        f"(default: {' '.join(default_formats())})", nargs="+", choices=BLOCK_FORMATS, metavar="FORMAT"))


OPTIONS = TuneOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TuneOptions)


def error(text: str) -> int:
    print(f"epdserve tune: error: {text}", file=sys.stderr)
    return 2


def run(args: TuneOptions) -> int:
    threads = sorted(set(args.threads or default_threads()))
    formats = list(dict.fromkeys(args.weight_formats or default_formats()))
    bad = [n for n in threads if not 1 <= n <= len(os.sched_getaffinity(0))]
    if bad:
        return error(f"--threads {bad[0]}: between 1 and the {len(os.sched_getaffinity(0))} cores this process may use")
    if not kernels.available():
        print("epdserve tune: nothing to measure: the C++ kernels did not build (they need AVX2 and FMA), "
              "so no worker has a cut-over", file=sys.stderr)
        return 1
    try:
        info = resolve_model(args.model)
    except ModelLoadError as exc:
        return error(f"--model {args.model}: {exc}")
    if info.multimodal:
        return error(f"--model {args.model}: a vision-language model's language model holds no GGUF blocks "
                     "(its workers run dense weights): nothing to measure")
    print(f"{kernels.cpu_model()}, flags: {' '.join(kernels.speed_flags())}, torch {torch.__version__}; "
          f"model {info.name}")
    for n in threads:
        torch.set_num_threads(n)
        for fmt in formats:
            try:
                model = LlamaModel.load(info.path, weight_format=fmt, retune=True)
            except (ValueError, ModelLoadError) as exc:
                return error(f"--weight-formats {fmt}: {exc}")
            # The step budget of an engine with the model's own KV cache dtype (the default).
            budget = step_budget.measured(model, model.dtype, force=True)
            for name, t in {**model.tuned, "max_num_batched_tokens": budget}.items():
                print(f"  {n} thread{'s' if n > 1 else ' '}  {fmt:<10} {name} {t.value:<4} ({t.source}; {t.path})",
                      flush=True)
    return 0
