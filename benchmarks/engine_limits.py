"""The machine's ceilings for the engine's model, measured on the engine's threads: what a
prefill or a decode step could reach here at best, so that an engine's figures can be read
as a share of it.

* **GEMM GFLOP/s**: ``[T, K] x [K, N]`` (the weight transposed, as ``F.linear`` runs it)
  by every GEMM library torch offers here, the best per shape: ``torch.mm`` (MKL's or
  OpenBLAS's sgemm) and oneDNN on a weight packed once (``mkldnn._linear_pointwise``, what
  the engine and vLLM's CPU backend run), for ``T`` in ``--tokens`` (default 256 and 1024) and every weight
  matmul of one decoder layer, fused as the engine runs them (``model/llama.py``): QKV
  (hidden -> (heads + 2 x KV heads) x head_dim), O (heads x head_dim -> hidden), gate/up
  (hidden -> 2 x intermediate) and down (intermediate -> hidden), shapes from the model's
  ``config.json``. Per shape: 2 T N K FLOPs over the best time of its repetitions; per T
  the FLOP-weighted aggregate: the weight-matmul FLOPs of one forward pass (layers x the
  sum over shapes) over the summed best times (layers x the sum), which is what a prefill
  of T tokens could reach in its matmuls. float32 always; bfloat16 too where the CPU has
  native bfloat16 arithmetic (``/proc/cpuinfo`` flags ``avx512_bf16``, ``amx_bf16``, or
  Arm's ``bf16``), else reported as skipped.
* **Memory GB/s**: ``dst.copy_(src)`` of a ``--mem-mib`` float32 tensor (bytes read +
  bytes written over the best time), and a read-only bandwidth (``src.sum()``: bytes read
  over the best time).
* **Decode step bytes and the roofline floor**: the bytes one decode step of B sequences
  at context L must read: every linear weight as the engine holds it (the GGUF's Q4_1 /
  Q8_0 blocks of ``quantized/blocks.safetensors``, 24 / 36 bytes per 32 weights: float32
  scale (and min) plus the quants, when the engine computes from them (``model/quant.py``:
  float32 on the CPU with the C++ kernels available), else dense float32), the LM head
  (tied to the embedding in SmolLM2: its Q8_0 blocks), the norms (float32), B rows of the
  float32 embedding table, and the KV cache, 2 x layers x KV heads x head_dim x L x bytes
  per element (the engine's KV dtype: its model dtype, float32 on the CPU) per sequence.
  floor ms = bytes / copy GB/s: no decode step can be faster while it reads those bytes
  at that rate.

Every loop is bounded in count and in time (``--seconds`` per shape, dtype and library, default
0.5 s, at most 48 repetitions, the shapes taking turns over 3 rounds so that a busy moment
of a shared machine does not fall on all of one shape's; the bandwidths: at most 10
repetitions or 3 s each). The best repetition is the ceiling; the median is printed too:
far below the best, the machine was busy.
:func:`measure` is what other scripts import (``benchmarks/speed.py``); it sets torch's
thread count for its own run and restores it afterwards; importing sets nothing.

    .venv/bin/python benchmarks/engine_limits.py [--threads N] [--model GGUF|DIR] \\
        [--tokens 256 1024] [--batches 1 8] [--context 384] [--output DIR]

Prints a table; with ``--output DIR`` also writes ``DIR/engine_limits.json`` (the dict of
:func:`measure`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

DEFAULT_TOKENS = (256, 1024)
DEFAULT_BATCHES = (1, 8)
DEFAULT_CONTEXT = 384  # speed.py's default: a 256-token prompt + template, halfway through 128 outputs
GEMM_SECONDS = 0.5  # per shape, dtype and library
GEMM_MAX_REPS = 48  # per shape, dtype and library, over all rounds
GEMM_ROUNDS = 3  # the shapes take turns, one round after another
MEM_MIB = 256
MEM_SECONDS = 3.0
MEM_MAX_REPS = 10
# x86 AVX512-BF16 / AMX-BF16, Arm BF16: the flags the engine's --dtype auto reads
# (epdserve.model.loader.BF16_CPU_FLAGS).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
# Block bytes per 32 weights as the engine holds them (model/quant.py: float32 d and m).
ENGINE_BLOCK_BYTES = {"q4_1": 16 + 4 + 4, "q8_0": 32 + 4}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                     "I8": 1, "U8": 1, "BOOL": 1}
FORMATS = ("engine", "float32", "gguf")


# ---------------------------------------------------------------------------------------
# The model's shapes and bytes


def model_config(model_dir: str | Path) -> dict:
    """The fields of ``config.json`` this script uses (head_dim defaults to hidden / heads,
    KV heads to heads, as ``epdserve.model.config``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
            "num_hidden_layers": cfg["num_hidden_layers"], "num_attention_heads": heads,
            "num_key_value_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "vocab_size": cfg["vocab_size"],
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False))}


def matmul_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """One decoder layer's weight matmuls as the engine runs them: ``name -> (N, K)``
    (output features, input features)."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * cfg["intermediate_size"], h),
            "down": (h, cfg["intermediate_size"])}


def forward_flops(cfg: dict, tokens: float) -> float:
    """Weight-matmul FLOPs of ``tokens`` tokens through every decoder layer: 2 x T x N x K
    per matmul (the LM head, which a prefill runs on its last row only, is left out)."""
    return 2.0 * tokens * cfg["num_hidden_layers"] * sum(n * k for n, k in matmul_shapes(cfg).values())


def kv_bytes_per_token(cfg: dict, elem_bytes: int) -> int:
    """KV cache bytes of one token: 2 (K and V) x layers x KV heads x head_dim x bytes."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * elem_bytes


def safetensors_tensors(path: str | Path) -> dict[str, dict]:
    """``name -> {"dtype", "shape", "nbytes"}`` from a safetensors file's header (nothing
    else is read)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: {"dtype": t["dtype"], "shape": t["shape"],
                   "nbytes": t["data_offsets"][1] - t["data_offsets"][0]}
            for name, t in header.items() if name != "__metadata__"}


def _linear_groups(cfg: dict, names: set[str]) -> list[list[str]]:
    """The projections the engine builds (``linear.projection``), each a list of HF weight
    names run as one matmul: per layer QKV, O, gate+up, down; and the LM head."""
    groups = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        groups += [[p + f"self_attn.{n}_proj.weight" for n in "qkv"], [p + "self_attn.o_proj.weight"],
                   [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [p + "mlp.down_proj.weight"]]
    head = "lm_head.weight"
    if cfg["tie_word_embeddings"] or head not in names:
        head = "model.embed_tokens.weight"
    return groups + [[head]]


def _block_groups(blocks: dict[str, dict], q4_1_layout: str = "gguf") -> dict[str, dict]:
    """``weight name -> {"nbytes": its qs + scales (+ mins), "kind": (qs dtype, has mins)}``; Q4_1's scales and
    mins at half their stored bytes in ``planes`` (``quant.to_planes``: float16)."""
    out: dict[str, dict] = {}
    q4_1 = {key.rsplit(".", 1)[0] for key in blocks if key.endswith(".mins")}
    for key, t in blocks.items():
        name, part = key.rsplit(".", 1)
        entry = out.setdefault(name, {"nbytes": 0, "qs": None, "mins": False})
        halved = q4_1_layout == "planes" and name in q4_1 and part in ("scales", "mins")
        entry["nbytes"] += t["nbytes"] // 2 if halved else t["nbytes"]
        entry["qs"] = t["dtype"] if part == "qs" else entry["qs"]
        entry["mins"] = entry["mins"] or part == "mins"
    return out


def engine_holds_blocks(model_dir: str | Path) -> bool:
    """Whether epdserve's default decode worker (float32 on the CPU, ``--weight-format auto``) runs
    its linear layers on the GGUF blocks: a blocks file and the C++ kernels (built on first
    use, as the engine builds them; ``model/quant.usable``)."""
    from epdserve.model import quant

    return quant.usable(model_dir)


def weight_read_bytes(model_dir: str | Path, fmt: str = "engine", elem_bytes: int = 4,
                      gguf_path: str | Path | None = None, q4_1_layout: str = "gguf") -> dict:
    """The weight bytes one decode step reads, by part.

    ``fmt``: ``engine`` (as epdserve holds them: GGUF blocks where :func:`engine_holds_blocks`,
    else dense), ``float32`` (every weight dense at ``elem_bytes``: a ``--dtype float32``
    Hugging Face engine such as vLLM or transformers), ``gguf`` (the GGUF file's own
    tensors as llama.cpp reads them, ``gguf_path``). ``q4_1_layout``: the engine's (its /health ``tuned``):
    ``planes`` holds a Q4_1 block in 20 bytes, as the GGUF, the stored ``gguf`` one in 24.

    Returns ``{"format", "linear", "lm_head", "other", "embedding_row", "fixed"}``: bytes
    of the decoder layers' linear weights, of the LM head, of every other tensor read in
    full (norms, biases), of one embedding row (read once per sequence), and ``fixed`` =
    linear + lm_head + other (read once per step whatever the batch).
    """
    if fmt == "gguf":
        return _gguf_read_bytes(gguf_path)
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from epdserve.model.quant import BLOCKS_FILE

    model_dir = Path(model_dir)
    cfg = model_config(model_dir)
    dense: dict[str, dict] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        dense.update(safetensors_tensors(file))
    blocks = {}
    if fmt == "engine" and engine_holds_blocks(model_dir):
        blocks = _block_groups(safetensors_tensors(model_dir / BLOCKS_FILE), q4_1_layout)
    numel = {name: math.prod(t["shape"]) for name, t in dense.items()}
    groups = _linear_groups(cfg, set(dense))
    part = {"linear": 0, "lm_head": 0}
    for i, group in enumerate(groups):
        kinds = {(blocks[n]["qs"], blocks[n]["mins"]) if n in blocks else None for n in group}
        if None in kinds or len(kinds) > 1:  # linear.projection keeps such a group dense
            size = sum(numel[n] for n in group) * elem_bytes
        else:
            size = sum(blocks[n]["nbytes"] for n in group)
        part["lm_head" if i == len(groups) - 1 else "linear"] += size
    linear_names = {n for g in groups for n in g}
    other = sum(numel[n] * elem_bytes for n in dense
                if n not in linear_names and n != "model.embed_tokens.weight")
    return {"format": "gguf-blocks" if blocks else f"dense float{8 * elem_bytes}",
            "linear": part["linear"], "lm_head": part["lm_head"], "other": other,
            "embedding_row": cfg["hidden_size"] * elem_bytes,
            "fixed": part["linear"] + part["lm_head"] + other}


def _gguf_read_bytes(gguf_path: str | Path | None) -> dict:
    """:func:`weight_read_bytes` for llama.cpp: every GGUF tensor in its own type; the
    token embedding is read in full when it is also the output (no ``output.weight``),
    else one row per sequence."""
    if gguf_path is None:
        raise ValueError("format gguf: needs the GGUF file")
    from gguf import GGUFReader

    read = GGUFReader(str(gguf_path)).tensors
    tensors = {t.name: int(t.n_bytes) for t in read}
    embd = tensors.get("token_embd.weight", 0)
    rows = next((int(t.shape[-1]) for t in read if t.name == "token_embd.weight"), 1)  # [hidden, vocab]
    tied = "output.weight" not in tensors
    head = embd if tied else tensors["output.weight"]
    linear = sum(n for name, n in tensors.items() if name.endswith(".weight") and "norm" not in name
                 and name not in ("token_embd.weight", "output.weight"))
    other = sum(tensors.values()) - linear - embd - (0 if tied else head)
    return {"format": "gguf", "linear": linear, "lm_head": head, "other": other,
            "embedding_row": embd // max(rows, 1), "fixed": linear + head + other}


def decode_step_bytes(weights: dict, kv_per_token: int, batch: int, context: float) -> float:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens each reads: the
    fixed weight bytes, one embedding row per sequence and each sequence's KV cache."""
    return weights["fixed"] + batch * weights["embedding_row"] + batch * context * kv_per_token


def floor_ms(nbytes: float, gbs: float) -> float:
    """The roofline floor: ``nbytes`` at ``gbs`` GB/s (10^9 bytes per second), in ms."""
    return nbytes / (gbs * 1e9) * 1e3


# ---------------------------------------------------------------------------------------
# Measurements


def best_times(fn, budget_s: float, max_reps: int) -> list[float]:
    """Call ``fn`` once unmeasured, then time it until ``max_reps`` calls or ``budget_s``
    seconds (at least one measured call); the times in seconds."""
    fn()
    times, deadline = [], time.perf_counter() + budget_s
    while len(times) < max_reps and (not times or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def gemm(cfg: dict, tokens: int, dtype, budget_s: float = GEMM_SECONDS, max_reps: int = GEMM_MAX_REPS,
         rounds: int = GEMM_ROUNDS) -> dict:
    """GFLOP/s of every weight matmul shape at ``tokens`` rows in ``dtype`` and their
    FLOP-weighted aggregate (see the module doc). The shapes take turns over ``rounds``
    rounds (each with its share of ``budget_s`` and ``max_reps``), so that a busy moment
    on a shared machine does not fall on one shape's every repetition."""
    import torch

    gen = torch.Generator().manual_seed(0)
    calls, times = {}, {}
    for name, (n, k) in matmul_shapes(cfg).items():
        x = torch.randn(tokens, k, generator=gen).to(dtype)
        w = torch.randn(n, k, generator=gen).to(dtype)
        for lib, fn in gemm_calls(x, w).items():
            calls[name, lib], times[name, lib] = fn, []
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key] += best_times(fn, budget_s / rounds, max(1, max_reps // rounds))
    shapes, total_flops, total_s = {}, 0.0, 0.0
    for name, (n, k) in matmul_shapes(cfg).items():
        flops = 2.0 * tokens * n * k
        by_lib = {lib: sorted(ts) for (shape, lib), ts in times.items() if shape == name}
        lib = min(by_lib, key=lambda b: by_lib[b][0])
        ts = by_lib[lib]
        shapes[name] = {"n": n, "k": k, "flops": flops, "library": lib, "best_ms": ts[0] * 1e3,
                        "median_ms": ts[len(ts) // 2] * 1e3, "reps": len(ts),
                        "gflops": flops / ts[0] / 1e9, "gflops_median": flops / ts[len(ts) // 2] / 1e9,
                        "gflops_by_library": {b: flops / t[0] / 1e9 for b, t in by_lib.items()}}
        total_flops += flops
        total_s += ts[0]
    layers = cfg["num_hidden_layers"]
    return {"tokens": tokens, "shapes": shapes, "forward_flops": total_flops * layers,
            "forward_ms": total_s * layers * 1e3, "aggregate_gflops": total_flops / total_s / 1e9}


def gemm_calls(x, w) -> dict:
    """``x [T, K]`` times ``w [N, K]`` transposed, one call per library: ``blas`` (``torch.mm``) and, where torch
    has oneDNN, ``onednn`` on ``w`` packed once."""
    import torch

    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    calls = {"blas": lambda: torch.mm(x, w.t(), out=out)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        calls["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return calls


def memory_bandwidth(mib: int = MEM_MIB, budget_s: float = MEM_SECONDS, max_reps: int = MEM_MAX_REPS) -> dict:
    """Copy GB/s (read + written bytes) and read GB/s (``sum``) of a ``mib`` MiB float32
    tensor, best of at most ``max_reps`` within ``budget_s`` each."""
    import torch

    n = mib * 2**20 // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    nbytes = n * 4
    copy = min(best_times(lambda: dst.copy_(src), budget_s, max_reps))
    read = min(best_times(lambda: src.sum(), budget_s, max_reps))
    return {"bytes": nbytes, "copy_gbs": 2 * nbytes / copy / 1e9, "copy_best_ms": copy * 1e3,
            "read_gbs": nbytes / read / 1e9, "read_best_ms": read * 1e3}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty elsewhere)."""
    from epdserve.model.kernels import cpu_flags as flags

    return flags()


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``)."""
    from epdserve.model.kernels import cpu_model as model

    return model()


def speed_flags() -> list[str]:
    """This CPU's flags that decide the kernels' speed (``kernels.SPEED_FLAGS``)."""
    from epdserve.model.kernels import speed_flags as flags

    return flags()


def default_threads() -> int:
    """The cores this process may use (``os.sched_getaffinity``): what an epdserve worker
    started here gets (``serving/worker/setup.pin_to_cores``)."""
    return len(os.sched_getaffinity(0))


def measure(threads: int | None = None, model_dir: str | Path | None = None,
            tokens: tuple[int, ...] = DEFAULT_TOKENS, batches: tuple[int, ...] = DEFAULT_BATCHES,
            context: float = DEFAULT_CONTEXT, gemm_seconds: float = GEMM_SECONDS,
            mem_mib: int = MEM_MIB) -> dict:
    """Measure the ceilings on ``threads`` torch threads (None: :func:`default_threads`)
    for the model in ``model_dir`` (a Hugging Face directory; None: epdserve's default
    model). torch's thread count is restored afterwards.

    Returns a dict with keys ``threads``, ``cores``, ``machine``, ``cpu_flags`` (the
    relevant ones), ``model`` (:func:`model_config` and ``dir``), ``gemm`` (``"float32"``
    and, where measured, ``"bfloat16"``: ``{str(T): gemm(...)}``), ``bf16`` (``measured``
    and ``why``), ``memory`` (:func:`memory_bandwidth`) and ``decode``: ``weights``
    (:func:`weight_read_bytes` of the engine's format), ``kv_dtype``,
    ``kv_bytes_per_token``, ``context`` and ``floors``: one ``{"batch", "context",
    "bytes", "floor_ms", "floor_ms_read"}`` per batch (floor at the copy and at the read
    bandwidth).
    """
    import torch

    if model_dir is None:
        from epdserve.model.loader import resolve_model

        model_dir = resolve_model(None).path
    threads = threads or default_threads()
    cfg = model_config(model_dir)
    flags = cpu_flags()
    bf16_flags = sorted(set(BF16_FLAGS) & flags)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result_gemm = {"float32": {str(t): gemm(cfg, t, torch.float32, gemm_seconds) for t in tokens}}
        if bf16_flags:
            result_gemm["bfloat16"] = {str(t): gemm(cfg, t, torch.bfloat16, gemm_seconds) for t in tokens}
        memory = memory_bandwidth(mem_mib)
    finally:
        torch.set_num_threads(saved)
    weights = weight_read_bytes(model_dir, "engine")
    kv_elem = 4  # the engine's KV dtype is its model dtype: float32 on the CPU (serving/worker/setup)
    kv = kv_bytes_per_token(cfg, kv_elem)
    floors = []
    for b in batches:
        nbytes = decode_step_bytes(weights, kv, b, context)
        floors.append({"batch": b, "context": context, "bytes": nbytes,
                       "floor_ms": floor_ms(nbytes, memory["copy_gbs"]),
                       "floor_ms_read": floor_ms(nbytes, memory["read_gbs"])})
    return {"threads": threads, "cores": sorted(os.sched_getaffinity(0)),
            "machine": cpu_model(),
            "cpu_flags": speed_flags(),
            "model": {"dir": str(model_dir), **cfg},
            "gemm": result_gemm,
            "bf16": {"measured": bool(bf16_flags),
                     "why": (f"CPU flags {', '.join(bf16_flags)}" if bf16_flags else
                             f"no native bfloat16 ({', '.join(BF16_FLAGS)} not in /proc/cpuinfo)")},
            "memory": memory,
            "decode": {"weights": weights, "kv_dtype": "float32", "kv_bytes_per_token": kv,
                       "context": context, "floors": floors}}


def prefill_ceiling(limits: dict, tokens: float, dtype: str = "float32") -> tuple[int, float]:
    """The aggregate GEMM GFLOP/s in ``dtype`` ("float32", or "bfloat16" where measured)
    at the ``T`` nearest ``tokens`` (in log scale): ``(T, GFLOP/s)``."""
    measured = {int(t): g["aggregate_gflops"] for t, g in limits["gemm"][dtype].items()}
    t = min(measured, key=lambda m: abs(math.log(m / max(tokens, 1))))
    return t, measured[t]


# ---------------------------------------------------------------------------------------
# CLI


def table(limits: dict) -> list[str]:
    """The printed report of :func:`measure`'s dict."""
    m, mem, dec = limits["model"], limits["memory"], limits["decode"]
    lines = [f"{limits['machine']}, {limits['threads']} threads (cores {limits['cores']}), "
             f"flags: {' '.join(limits['cpu_flags'])}",
             f"model {Path(m['dir']).name}: hidden {m['hidden_size']}, intermediate "
             f"{m['intermediate_size']}, {m['num_attention_heads']} heads, {m['num_key_value_heads']} "
             f"KV heads, head_dim {m['head_dim']}, {m['num_hidden_layers']} layers, vocab {m['vocab_size']}",
             "", "GEMM ([T, K] x [K, N], the best of torch.mm (blas) and packed oneDNN), GFLOP/s of the best "
             "repetition (median) and its library"]
    for dtype, per_t in limits["gemm"].items():
        for t, g in per_t.items():
            lines.append(f"  {dtype:<9} T={t:<5}" + "".join(
                f"  {name} {s['n']}x{s['k']}: {s['gflops']:.1f} ({s['gflops_median']:.1f}) {s['library']}"
                for name, s in g["shapes"].items()))
            lines.append(f"  {'':<9} {'':<7} aggregate (one forward's weight matmuls): "
                         f"{g['aggregate_gflops']:.1f} GFLOP/s, {g['forward_flops'] / 1e9:.2f} GFLOP "
                         f"in {g['forward_ms']:.1f} ms")
    if not limits["bf16"]["measured"]:
        lines.append(f"  bfloat16: skipped: {limits['bf16']['why']}")
    lines += ["", f"memory ({mem['bytes'] / 2**20:.0f} MiB float32): copy {mem['copy_gbs']:.2f} GB/s "
                  f"(read + written), read {mem['read_gbs']:.2f} GB/s (sum)", ""]
    w = dec["weights"]
    lines.append(f"decode step bytes ({w['format']}): linear {w['linear'] / 1e6:.2f} MB, LM head "
                 f"{w['lm_head'] / 1e6:.2f} MB, norms/other {w['other'] / 1e6:.3f} MB, "
                 f"{w['embedding_row']} B per embedding row; KV {dec['kv_dtype']} "
                 f"{dec['kv_bytes_per_token']} B per token")
    for f in dec["floors"]:
        lines.append(f"  batch {f['batch']:>3}, context {f['context']:g}: {f['bytes'] / 1e6:.2f} MB -> "
                     f"floor {f['floor_ms']:.2f} ms per step at the copy bandwidth "
                     f"({f['floor_ms_read']:.2f} ms at the read bandwidth)")
    return lines


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: the cores this process may use, os.sched_getaffinity)")
    p.add_argument("--model", default=None, metavar="GGUF|DIR",
                   help="the model (default: epdserve's default model)")
    p.add_argument("--tokens", type=positive_int, nargs="+", default=list(DEFAULT_TOKENS), metavar="T",
                   help="prefill rows of the GEMMs (default 256 1024)")
    p.add_argument("--batches", type=positive_int, nargs="+", default=list(DEFAULT_BATCHES), metavar="B",
                   help="decode batch sizes of the roofline floor (default 1 8)")
    p.add_argument("--context", type=positive_int, default=DEFAULT_CONTEXT, metavar="L",
                   help=f"tokens of context per sequence for the KV bytes (default {DEFAULT_CONTEXT})")
    p.add_argument("--seconds", type=float, default=GEMM_SECONDS, metavar="S",
                   help=f"time budget per GEMM shape, dtype and library (default {GEMM_SECONDS})")
    p.add_argument("--mem-mib", type=positive_int, default=MEM_MIB, metavar="MIB",
                   help=f"size of the copied tensor (default {MEM_MIB})")
    p.add_argument("--output", default=None, metavar="DIR", help="write DIR/engine_limits.json")
    args = p.parse_args(argv)

    from epdserve.model.loader import ModelLoadError, resolve_model

    try:
        model_dir = resolve_model(args.model).path
    except ModelLoadError as exc:
        print(f"engine_limits: error: {exc}", file=sys.stderr)
        return 1
    limits = measure(args.threads, model_dir, tuple(args.tokens), tuple(args.batches), args.context,
                     args.seconds, args.mem_mib)
    print("\n".join(table(limits)))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine_limits.json").write_text(json.dumps(limits, indent=2) + "\n")
        print(f"\nwritten: {out / 'engine_limits.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
