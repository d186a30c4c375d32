"""Decode attention over the paged KV cache, as a share of the machine's read bandwidth.

The engine's decode attention (``layer_ops.paged_decode_attention``: the C++ kernel where it
is built) runs over every layer's cache of ``--batch`` sequences at ``--context`` positions,
their blocks scattered over the pool as a busy engine leaves them, with the default model's
heads (``config.json``) and ``--threads`` torch threads. Per cell (batch, context, KV dtype):
the median and best time of the layers' calls, the bytes they read (keys and values, 2 x
layers x batch x context x KV heads x head_dim x the dtype's size) over the median, and that
rate as a share of the read bandwidth (``engine_limits.memory_bandwidth``: ``sum`` of a
256 MiB tensor) measured in the same run. Each cell repeats ``--reps`` times, within
``--seconds`` (one at least); a median far above the best says the machine was busy.

    .venv/bin/python benchmarks/decode_attention.py [--cells 32x320 8x1024 1x2048]
        [--kv-dtypes float32 bfloat16] [--threads N] [--output DIR]

With ``--output DIR``: ``DIR/decode_attention.json`` and ``DIR/decode_attention.png`` (the
share of the read bandwidth per cell and dtype).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import engine_limits  # benchmarks/
from epdserve.model import layer_ops
from epdserve.model.loader import resolve_model

BLOCK = 16  # positions a KV block, the engine's default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cell(text: str) -> tuple[int, int]:
    """``BxL`` (batch x context) as two positive ints."""
    try:
        batch, context = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BATCHxCONTEXT, e.g. 32x320") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and context must be positive")
    return batch, context


def run_cell(cfg: dict, batch: int, context: int, dtype: torch.dtype, reps: int, seconds: float) -> dict:
    """Times of every layer's decode attention for one step; bytes read and GB/s at the median."""
    heads, kv_heads, dim, layers = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                    cfg["num_hidden_layers"])
    per_row = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, batch * per_row * BLOCK, kv_heads, dim, generator=gen).to(dtype) for _ in range(layers)]
    tables = torch.randperm(batch * per_row, generator=gen).view(batch, per_row)
    lens = torch.full((batch,), context, dtype=torch.long)
    q = torch.randn(batch, heads, dim, generator=gen)

    def step() -> None:
        for cache in caches:
            layer_ops.paged_decode_attention(q, cache[0], cache[1], tables, lens, BLOCK)

    times = sorted(engine_limits.best_times(step, seconds, reps))
    nbytes = 2 * layers * batch * context * kv_heads * dim * caches[0].element_size()
    median = statistics.median(times)
    return {"batch": batch, "context": context, "kv_dtype": str(dtype).removeprefix("torch."),
            "median_ms": median * 1e3, "best_ms": times[0] * 1e3, "bytes": nbytes, "gbs": nbytes / median / 1e9}


def plot(rows: list[dict], read_gbs: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['batch']}x{r['context']}\n{r['kv_dtype']}" for r in rows]
    ax.bar(labels, [100 * r["gbs"] / read_gbs for r in rows])
    ax.set_ylabel("% of the read bandwidth")
    ax.set_title(f"decode attention, {engine_limits.cpu_model()}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=cell, nargs="+", default=[(32, 320), (8, 1024), (1, 2048)], metavar="BxL")
    p.add_argument("--kv-dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--threads", type=engine_limits.positive_int, default=engine_limits.default_threads(), metavar="N")
    p.add_argument("--reps", type=engine_limits.positive_int, default=9, metavar="N")
    p.add_argument("--seconds", type=float, default=10.0, metavar="S",
                   help="the most a cell's repetitions may take (one at least)")
    p.add_argument("--output", type=Path, default=None, metavar="DIR")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = engine_limits.model_config(resolve_model(None).path)
    memory = engine_limits.memory_bandwidth()
    print(f"{engine_limits.cpu_model()}, {args.threads} threads, flags: {' '.join(engine_limits.speed_flags())}, "
          f"torch {torch.__version__}; read bandwidth {memory['read_gbs']:.1f} GB/s", flush=True)
    rows = []
    for dtype in args.kv_dtypes:
        for batch, context in args.cells:
            r = run_cell(cfg, batch, context, DTYPES[dtype], args.reps, args.seconds)
            rows.append(r)
            print(f"  batch {batch:3d}, context {context:5d}, {dtype:8s}: {r['median_ms']:7.2f} ms "
                  f"[best {r['best_ms']:.2f}] for {cfg['num_hidden_layers']} layers, {r['gbs']:5.1f} GB/s = "
                  f"{100 * r['gbs'] / memory['read_gbs']:.0f}% of the read bandwidth", flush=True)
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        result = {"cpu": engine_limits.cpu_model(), "cpu_flags": engine_limits.speed_flags(), "threads": args.threads,
                  "torch": torch.__version__, "memory": memory, "cells": rows}
        (args.output / "decode_attention.json").write_text(json.dumps(result, indent=2))
        plot(rows, memory["read_gbs"], args.output / "decode_attention.png")
        print(f"written: {args.output / 'decode_attention.json'}, {args.output / 'decode_attention.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
