"""An encode worker's vision tower split over tensor-parallel ranks (``serve --encode-tp N``)
against one process, on the default VLM's SigLIP-base tower (float32, 512-pixel tiles).

Rows, each encoding ``--tiles`` distinct images (one tile each, so the embedding cache never
answers) per repetition, through the encode engine:

* ``one process, C threads``: the whole tower on this process's C cores (the baseline: what
  an encode worker of one rank runs);
* ``one process, 1 thread``: the whole tower on one core;
* ``TP=N``: this process rank 0 and N-1 follower processes (``serving/worker/ranks.py``),
  one thread each, the followers pinned to the next cores (round-robin), gloo over
  127.0.0.1 (two all-reduces of ``[tiles, 1024, 768]`` a layer).

The rows run round-robin, so that load from other processes hits each alike. Per row: ms per
tile (median over ``--reps``), the ratio to the baseline's (above 1: slower) and the GFLOP/s
reached on the tower's matmul and attention FLOPs (:func:`tile_flops`). On a CPU the ranks
share memory bandwidth and pay for the all-reduces, so TP=N runs below N one-thread
processes' worth; on GPUs the all-reduces run over NVLink.

    .venv/bin/python benchmarks/encode_tp.py [--tp 2] [--tiles 8] [--reps 3] [--output DIR]

With ``--output DIR``: ``DIR/encode_tp.json`` and ``DIR/encode_tp.png``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from epdserve.engine.encoder import EncodeEngine
from epdserve.model.image_processor import ImageInput
from epdserve.model.loader import resolve_model
from epdserve.model.vision import VisionConfig
from epdserve.serving.worker.ranks import Ranks


def tile_flops(c: VisionConfig) -> float:
    """FLOPs of one tile through the tower: per layer, 2 x patches x (QKV 3d² + O d² + MLP
    2 d x intermediate) for the matmuls and 2 x 2 x patches² x d for attention (QK^T and
    AV), plus the patch embedding and the connector (after the pixel shuffle)."""
    p, d = c.patches_per_side ** 2, c.hidden_size
    layer = 2 * p * (4 * d * d + 2 * d * c.intermediate_size) + 4 * p * p * d
    patch = 2 * p * d * c.num_channels * c.patch_size ** 2
    connector = 2 * c.tokens_per_image * d * c.scale_factor ** 2 * c.text_hidden_size
    return c.num_hidden_layers * layer + patch + connector


def images(n: int, seed: int) -> list[ImageInput]:
    """``n`` distinct seeded random PNGs of 512 x 384 pixels (one tile each)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        data = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (384, 512, 3), dtype=np.uint8)).save(data, "PNG")
        out.append(ImageInput.from_bytes(data.getvalue(), "benchmark"))
    return out


def measure(args) -> dict:
    model_dir = str(resolve_model("vlm").path)
    cores = sorted(os.sched_getaffinity(0))
    whole = EncodeEngine(model_dir)
    ranks = Ranks.start(args.tp, "encode-tp-benchmark", model_dir, "float32", "auto", "cpu",
                        [[cores[r % len(cores)]] for r in range(args.tp)], part="vision")
    try:
        split = EncodeEngine(model_dir, tp=ranks)
        rows = {f"one process, {len(cores)} threads": (whole, len(cores)), "one process, 1 thread": (whole, 1),
                f"TP={args.tp}": (split, 1)}
        times: dict[str, list[float]] = {name: [] for name in rows}
        seed = 0
        with tqdm(total=(args.reps + 1) * len(rows), desc="encode batches") as bar:
            for rep in range(args.reps + 1):  # the first round warms up, unmeasured
                for name, (engine, threads) in rows.items():
                    torch.set_num_threads(threads)
                    batch, seed = images(args.tiles, seed), seed + 1
                    start = time.perf_counter()
                    engine.encode(batch)
                    if rep:
                        times[name].append((time.perf_counter() - start) * 1e3 / args.tiles)
                    bar.update()
    finally:
        ranks.close()
    flops = tile_flops(whole.vision.config)
    base = statistics.median(next(iter(times.values())))
    out = {}
    for name, ms in times.items():
        med = statistics.median(ms)
        out[name] = {"ms_per_tile": med, "all_ms": ms, "vs_baseline": med / base, "gflops": flops / med / 1e6}
    return {"tiles": args.tiles, "reps": args.reps, "tp": args.tp, "cores": cores, "tile_gflop": flops / 1e9,
            "rows": out}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["rows"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, [result["rows"][n]["ms_per_tile"] for n in names], color=["grey", "silver", "tab:blue"])
    ax.invert_yaxis()
    ax.set_xlabel("ms per 512-pixel tile (median)")
    ax.set_title(f"vision tower, {result['tiles']} tiles a batch, cores {result['cores']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks of the split tower")
    parser.add_argument("--tiles", type=int, default=8, help="tiles (distinct images) a batch")
    parser.add_argument("--reps", type=int, default=3, help="measured batches a row")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args)
    print(f"\nvision tower: {result['tile_gflop']:.0f} GFLOP a tile, {args.tiles} tiles a batch, {args.reps} reps")
    print(f"{'row':<28}{'ms / tile':>10}{'vs baseline':>13}{'GFLOP/s':>9}")
    for name, row in result["rows"].items():
        print(f"{name:<28}{row['ms_per_tile']:>10.0f}{row['vs_baseline']:>13.2f}{row['gflops']:>9.0f}")
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "encode_tp.json").write_text(json.dumps(result, indent=1))
        plot(result, args.output / "encode_tp.png")
        print(f"written: {args.output / 'encode_tp.json'}, {args.output / 'encode_tp.png'}")


if __name__ == "__main__":
    main()
