"""Where a linear layer's matmul should leave the GGUF block kernel for the BLAS, measured on
the engine's threads: the cut-overs of ``epdserve/model/linear.py``.

For every row count M in ``--rows`` it times the projections of every decoder layer of the
default model (QKV, O, gate+up, down, as the engine fuses them), as a step runs them, four
ways (one layer timed alone stays in the CPU's cache and flatters the dense copies):

* ``kernel``: ``quant_mm`` on the layer's Q4_1 blocks (``model/quant_kernels.cpp``);
* ``dequant+sgemm``: dequantize the blocks, then ``F.linear`` in float32 (what a worker
  holding the blocks only runs above its cut-over);
* ``f32``: ``F.linear`` on a resident float32 copy (MKL's sgemm);
* ``bf16``: the activations cast to bfloat16, ``F.linear`` on a resident bfloat16 copy, the
  result cast back (oneDNN's AVX512-BF16 / AMX kernels), where the CPU computes bfloat16
  natively (else skipped).

Each figure is the best of at most ``MAX_REPS`` calls or ``--seconds`` per row count and way,
the ways taking turns over three rounds. Printed: ms per step, and against each way the
most rows the engine would run on the kernel (the largest M below the first from which that
way stays faster; ``epdserve/model/cutover.py``): dequant+sgemm for a worker holding the
blocks only, f32 or bf16 for one holding a resident copy too.

    .venv/bin/python benchmarks/linear_cutover.py [--threads 2] [--rows 1 2 4 ...] [--output DIR]

With ``--output DIR``: ``DIR/linear_cutover.json`` and ``DIR/linear_cutover.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_limits  # noqa: E402 (benchmarks/ is not a package)
from epdserve.model.cutover import kernel_rows_for  # noqa: E402

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
SECONDS = 0.3  # per row count and way
MAX_REPS = 30
ROUNDS = 3
WAYS = ("kernel", "dequant+sgemm", "f32", "bf16")


def layer_calls(weights: list[tuple], rows: int, bf16: bool) -> dict:
    """The four ways (:data:`WAYS`) of running a step's projections on ``rows`` rows:
    ``name -> fn``; ``weights``: every layer's projections as ``(quant.Blocks, float32
    copy, bfloat16 copy or None)``."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(rows)
    mm, deq = torch.ops.epdserve.quant_mm.default, torch.ops.epdserve.dequantize.default
    xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for _, w, _ in weights}}
    parts = [(xs[w.shape[1]], b, w, w16) for b, w, w16 in weights]
    calls = {
        "kernel": lambda: [mm(x, b.qs, b.scales, b.mins) for x, b, _, _ in parts],
        "dequant+sgemm": lambda: [F.linear(x, deq(b.qs, b.scales, b.mins)) for x, b, _, _ in parts],
        "f32": lambda: [F.linear(x, w) for x, _, w, _ in parts],
    }
    if bf16:
        calls["bf16"] = lambda: [F.linear(x.to(torch.bfloat16), w16).float() for x, _, _, w16 in parts]
    return calls


def fused_blocks(blocks: dict, prefix: str) -> dict:
    """One decoder layer's projections (name -> ``quant.Blocks``) fused as the engine fuses
    them; ``prefix``: the layer's tensor names' (``model.layers.N.``)."""
    import torch

    from epdserve.model import quant

    groups = {"qkv": [f"self_attn.{n}_proj.weight" for n in "qkv"], "o": ["self_attn.o_proj.weight"],
              "gate_up": ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "down": ["mlp.down_proj.weight"]}
    return {name: quant.Blocks(*(torch.cat([getattr(blocks[prefix + n], part) for n in names])
                                 for part in ("qs", "scales", "mins")))
            for name, names in groups.items()}


def measure(threads: int, rows_list: tuple[int, ...], seconds: float = SECONDS) -> dict:
    """Time :func:`layer_calls` for every row count on ``threads`` torch threads; returns
    ``{"threads", "bf16", "rows": {M: {way: best ms}}, "kernel_rows": {way: M}}``: the most
    rows to run on the kernel against each way, as the engine picks them
    (``epdserve.model.cutover.kernel_rows_for``)."""
    import torch

    from epdserve.model import kernels, quant
    from epdserve.model.config import ModelConfig
    from epdserve.model.loader import resolve_model

    if not kernels.available():
        raise SystemExit("linear_cutover: the C++ kernels did not build (they need AVX2 and FMA)")
    model = resolve_model().path
    blocks = quant.load_blocks(model)
    if not blocks:
        raise SystemExit("linear_cutover: the default model has no GGUF blocks")
    bf16 = bool(set(engine_limits.BF16_FLAGS) & engine_limits.cpu_flags())
    weights = []
    for i in range(ModelConfig.from_dir(model).num_hidden_layers):
        for b in fused_blocks(blocks, f"model.layers.{i}.").values():
            w = torch.ops.epdserve.dequantize(b.qs, b.scales, b.mins)
            weights.append((b, w, w.to(torch.bfloat16) if bf16 else None))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for rows in rows_list:
            calls = layer_calls(weights, rows, bf16)
            times = {way: [] for way in calls}
            for _ in range(ROUNDS):
                for way, fn in calls.items():
                    times[way] += engine_limits.best_times(fn, seconds / ROUNDS, MAX_REPS // ROUNDS)
            out[rows] = {way: min(t) * 1e3 for way, t in times.items()}
            print(f"  M={rows:4d}  " + "  ".join(f"{w} {ms:7.3f} ms" for w, ms in out[rows].items()), flush=True)
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "bf16": bf16, "rows": out,
            "kernel_rows": {way: kernel_rows_for({m: (r["kernel"], r[way]) for m, r in out.items()})
                            for way in WAYS[1:] if way in out[rows_list[0]]}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["rows"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for way in WAYS[1:]:
        if way in result["rows"][rows[0]]:
            ax.plot(rows, [result["rows"][m][way] / result["rows"][m]["kernel"] for m in rows], marker="o", label=way)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows M (tokens in the step)")
    ax.set_ylabel("time / Q4_1 kernel's (below 1: faster)")
    ax.set_title(f"a step's projections (every layer), {result['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads (default: the cores this process may use, as a worker)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS))
    parser.add_argument("--seconds", type=float, default=SECONDS, help="per row count and way")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads < 1 or any(r < 1 for r in args.rows):
        parser.error("--threads and --rows take positive integers")
    print(f"linear cut-over, {args.threads} threads (ms per step's projections, best of repetitions)")
    result = measure(args.threads, tuple(sorted(set(args.rows))), args.seconds)
    for way, m in result["kernel_rows"].items():
        print(f"  against {way}: the kernel up to M = {m}")
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "linear_cutover.json").write_text(json.dumps(result, indent=1))
        plot(result, args.output / "linear_cutover.png")
        print(f"written: {args.output / 'linear_cutover.json'}, {args.output / 'linear_cutover.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
