"""The GPU check: one script, under 8 minutes on one H200, no downloads, one JSON.

Sections (each guarded: a failure is recorded under its name as ``{"ok": false, "error"}``
and the next one runs; the JSON is rewritten after each, so a run cut short keeps what it
measured; ``--budget-s`` skips what would start after it):

* ``ceilings``: the bf16 matrix peak (``torch.matmul`` of two N×N matrices; TFLOP/s =
  2N³/time) and the memory bandwidth (a device-to-device ``copy_`` of a large buffer;
  GB/s counts bytes read plus written, 1e9 bytes a GB), measured in this run.
* ``parity``: a small Llama with seeded random weights built as Hugging Face
  ``LlamaForCausalLM`` from a ``LlamaConfig``, saved as safetensors, and loaded into our
  engine; greedy tokens of 4 prompts compared, our engine one at a time and batched,
  against transformers one at a time (float32 on both: exact equality is the goal).
* ``tensor_parallel``: that Llama in our engine at TP=2 vs TP=1 (:mod:`gpu_check_tp`): greedy
  tokens (equal is the goal) and max |logit difference| of a batched prefill and decode steps;
  ms in the collectives a step, all-reduces of ``[T, hidden]`` timed in a loop, and the KV
  hand-off TP=2 -> TP=1 and back through the real exporter and importer. NCCL, rank r
  on ``cuda:r``, with 2+ GPUs; gloo with both ranks on the one GPU with one (parity only); gloo
  on the CPU with ``--device cpu``.
* ``throughput``: a Llama-3.1-8B-shaped model (:data:`gpu_check_serve.LLAMA_8B`) with
  random bf16 weights in our engine: prefill tokens/s on 2,048-token prompts as a fraction
  of the matrix peak (FLOPs = 2 x matmul parameters per token + causal attention), and
  decode tokens/s at batch 1, 32 and 128 as a fraction of the memory-bandwidth bound
  (bytes per step = matmul weights + the KV of every sequence's context; bound = bytes /
  bandwidth); on CUDA the decode steps replay CUDA graphs (``decode``) and run eagerly
  (``decode_eager``) on the same engine.
* ``attention`` (CUDA only): the Triton paged-attention kernels against the gathering
  PyTorch path on the 8B shape's heads (:mod:`epdserve.model.triton_attention`'s
  benchmark hooks): decode at batch 1, 32 and 128 over 4,096-token contexts (GB/s of K/V
  read, against the copy bandwidth) and a 2,048-token prefill behind 2,048 cached tokens.
* ``ipc_copy`` (CUDA only): the 8B shape's KV of 512 and 2,048-token prompts copied from
  another process's pool by CUDA IPC vs a device-to-device copy of the same bytes
  (:func:`ipc_bench.ipc_copy_benchmark`, ``benchmarks/ipc_bench.py``).
* ``handoff_1p1d``: ``epdserve serve --mode pd`` (router, one prefill and one decode worker
  process, both on ``--device``) of the 8B-shaped model: per prompt size, the trace's KV
  bytes, hand-off ms (export + router hop + fetch + import) and GB/s (bytes / fetch +
  import) vs a device-to-device copy of the same bytes.
* ``bursty``: colocated (one worker) vs that 1P1D deployment on one trace: 32 chats
  decoding while a few 8k-token prompts arrive; TTFT and ITL p50/p95/p99 (ms).

``--device cpu --smoke`` runs every section at tiny shapes (the 8B shape shrunk to
:data:`gpu_check_serve.TINY`, CUDA-only parts skipped) so that ``tests/test_gpu_check.py``
checks the script end to end. The goals are in ``goals`` (docs/gpu.md).

    PYTHONPATH=$PWD python benchmarks/gpu_check.py [--device cuda] [--output results/gpu_check.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_serve as S  # noqa: E402  (the benchmarks folder is not a package)
import gpu_check_tp as T  # noqa: E402

from epdserve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from epdserve.engine.request import SamplingParams  # noqa: E402

FULL = dict(matmul_n=8192, copy_bytes=4 << 30, parity_tokens=16, prefill_len=2048, prefill_batch=4,
            decode_batches=(1, 32, 128), decode_context=512, decode_steps=32, kv_mb=16384,
            handoff_sizes=(512, 2048), handoff_reps=5, chats=32, chat_prompt=256, chat_tokens=128,
            long_prompts=3, long_len=8192, long_tokens=16, serve_kv_mb=12288)
SMOKE = dict(matmul_n=256, copy_bytes=16 << 20, parity_tokens=8, prefill_len=64, prefill_batch=2,
             decode_batches=(1, 4), decode_context=32, decode_steps=4, kv_mb=64,
             handoff_sizes=(32, 64), handoff_reps=2, chats=4, chat_prompt=16, chat_tokens=8,
             long_prompts=2, long_len=128, long_tokens=4, serve_kv_mb=64)
GOALS = [  # (name, JSON path, comparison, target): the GPU path's goals on one H200
    ("decode_b1_vs_bandwidth_bound", ("throughput", "decode", "1", "vs_bandwidth_bound"), ">=", 0.6),
    ("prefill_vs_matmul_peak", ("throughput", "prefill", "vs_matmul_peak"), ">=", 0.4),
    ("ipc_vs_d2d_2048", ("ipc_copy", "2048", "ipc_vs_d2d"), ">=", 0.5),
    ("ipc_ms_2048", ("ipc_copy", "2048", "ipc_ms"), "<=", 2.0),
    ("parity_exact", ("parity", "exact"), "==", True),
    ("tp2_tokens_equal", ("tensor_parallel", "tokens_equal"), "==", True),
    ("tp_handoff_tokens_equal", ("tensor_parallel", "handoff", "tokens_equal"), "==", True),
]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(run, device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``run()`` in ms, the device's queue drained around each call."""
    for _ in range(warmup):
        run()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def report(name: str, value, ceiling=None, unit: str = "", fraction=None) -> None:
    """One printed number, with what it is measured against."""
    text = f"{value:,.3f}" if isinstance(value, float) else str(value)
    if ceiling is not None:
        text += f" {unit} (ceiling {ceiling:,.3f} {unit}; {fraction:.1%} of it)"
    elif unit:
        text += f" {unit}"
    tqdm.write(f"  {name}: {text}")


def ceilings(device: str, shape: dict) -> dict:
    """The bf16 matrix peak (TFLOP/s) and the copy bandwidth (GB/s, read + written)."""
    n = shape["matmul_n"]
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda: torch.matmul(a, b), device, repeats=10, warmup=3)
    peak = 2 * n**3 / ms / 1e9
    a = b = None  # freed before the copy's buffers
    src = torch.empty(shape["copy_bytes"], dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), device, repeats=10)
    bandwidth = 2 * src.numel() / copy_ms / 1e6
    report("bf16 matmul peak", peak, unit="TFLOP/s")
    report("device copy bandwidth (read + write)", bandwidth, unit="GB/s")
    return {"matmul_n": n, "matmul_tflops": peak, "copy_bytes": shape["copy_bytes"], "copy_ms": copy_ms,
            "bandwidth_gbps": bandwidth}


def hf_greedy(model, prompt: list[int], steps: int, device: str) -> list[int]:
    """transformers' greedy tokens (the whole sequence re-run each step: no cache to differ)."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Our engine's greedy tokens of ``prompts`` run together (one batch)."""
    sampling = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        out[str(i)] = []
        engine.add_request(str(i), prompt, sampling)
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id] += step.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def parity(device: str, shape: dict, workdir: Path) -> dict:
    """Greedy tokens of transformers vs our engine on the same seeded small Llama."""
    path = workdir / "parity-llama"
    model = S.parity_llama(path).to(device)
    prompts = S.parity_prompts()
    steps = shape["parity_tokens"]
    expected = [hf_greedy(model, p, steps, device) for p in prompts]
    engine = LLMEngine(str(path), EngineConfig(device=device, dtype="float32", kv_cache_memory_mb=64))
    single = [engine_greedy(engine, [p], steps)[0] for p in prompts]
    batched = engine_greedy(engine, prompts, steps)
    del engine, model
    result = {"dtype": "float32", "prompt_lens": [len(p) for p in prompts], "max_tokens": steps,
              "single_exact": single == expected, "batched_exact": batched == expected,
              "tokens_equal_single": sum(a == b for x, y in zip(single, expected) for a, b in zip(x, y)),
              "tokens_equal_batched": sum(a == b for x, y in zip(batched, expected) for a, b in zip(x, y)),
              "tokens": steps * len(prompts)}
    result["exact"] = result["single_exact"] and result["batched_exact"]
    report("greedy parity with transformers (one at a time, batched)",
           f"{result['single_exact']}, {result['batched_exact']}")
    return result


def matmul_params(config: dict) -> tuple[int, int]:
    """(parameters of the decoder layers' matmuls, of the LM head)."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return per_layer * config["num_hidden_layers"], config["vocab_size"] * h


def run_until_done(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def prefill_rate(engine: LLMEngine, config: dict, shape: dict, device: str, peak_tflops: float) -> dict:
    """Prefill tokens/s of ``prefill_batch`` prompts of ``prefill_len`` tokens run in one
    go (max_tokens 1), and its FLOP rate as a fraction of ``peak_tflops``."""
    n, length = shape["prefill_batch"], shape["prefill_len"]
    prompts = S.seeded_prompts(n + 1, length, config["vocab_size"], seed=2)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("warm", prompts[-1], one)
    run_until_done(engine)
    sync(device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts[:n]):
        engine.add_request(f"p{i}", prompt, one)
    run_until_done(engine)
    sync(device)
    seconds = time.perf_counter() - start
    layers, head = matmul_params(config)
    attention = 2 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"] * length**2
    flops = n * (2 * layers * length + 2 * head + attention)
    tflops = flops / seconds / 1e12
    out = {"prompts": n, "prompt_len": length, "seconds": seconds, "tokens_per_s": n * length / seconds,
           "tflops": tflops, "matmul_peak_tflops": peak_tflops, "vs_matmul_peak": tflops / peak_tflops}
    report(f"prefill {n}x{length} tokens", out["tokens_per_s"], unit="tok/s")
    report("prefill FLOP rate", tflops, peak_tflops, "TFLOP/s", out["vs_matmul_peak"])
    return out


def decode_rate(engine: LLMEngine, config: dict, shape: dict, batch: int, device: str, bandwidth: float) -> dict:
    """Decode tokens/s of ``batch`` sequences of ``decode_context`` prompt tokens over
    ``decode_steps`` steps, against the bandwidth bound: bytes read per step = matmul
    weights + each sequence's KV (its mean context over the timed steps)."""
    context, steps = shape["decode_context"], shape["decode_steps"]
    prompts = S.seeded_prompts(batch, context, config["vocab_size"], seed=3 + batch)
    sampling = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
    started: set[str] = set()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{batch}-{i}", prompt, sampling)
    while len(started) < batch:  # prefill steps: the timed ones then decode every sequence
        started.update(o.request_id for o in engine.step())
    engine.step()  # one decode step untimed (first decode shapes, allocator)
    sync(device)
    start = time.perf_counter()
    done = 0
    for _ in range(steps):
        done += sum(len(o.token_ids) for o in engine.step())
    sync(device)
    seconds = time.perf_counter() - start
    run_until_done(engine)
    layers, head = matmul_params(config)
    item = torch.tensor([], dtype=engine.kv_cache.dtype).element_size()
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * item
    step_bytes = (layers + head) * item + batch * (context + 2 + steps / 2) * kv_per_token
    bound = batch / (step_bytes / (bandwidth * 1e9))
    rate = done / seconds
    out = {"batch": batch, "context": context, "steps": steps, "tokens": done, "tokens_per_s": rate,
           "step_ms": seconds / steps * 1e3, "bytes_per_step": step_bytes, "bandwidth_gbps": bandwidth,
           "bound_tokens_per_s": bound, "vs_bandwidth_bound": rate / bound}
    report(f"decode batch {batch}", rate, bound, "tok/s", out["vs_bandwidth_bound"])
    return out


def throughput(device: str, shape: dict, model_dir: Path, config: dict, ceiling: dict) -> dict:
    """Prefill and decode rates of the 8B-shaped model in our engine."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    engine = LLMEngine(str(model_dir), EngineConfig(
        device=device, dtype=dtype, kv_cache_memory_mb=shape["kv_mb"], max_num_seqs=max(shape["decode_batches"]),
        enable_prefix_caching=False, max_num_batched_tokens=max(16384, shape["prefill_len"] * shape["prefill_batch"]),
        enforce_eager=not device.startswith("cuda")))

    def decode() -> dict:
        return {str(b): decode_rate(engine, config, shape, b, device, ceiling["bandwidth_gbps"])
                for b in shape["decode_batches"]}

    try:
        out = {"dtype": dtype, "prefill": prefill_rate(engine, config, shape, device, ceiling["matmul_tflops"]),
               "cuda_graphs": engine.graphs is not None}
        out["decode"] = decode()
        if engine.graphs is not None:  # the same steps eager: what the graphs are worth
            graphs, engine.graphs = engine.graphs, None
            tqdm.write("  decode without CUDA graphs:")
            out["decode_eager"] = decode()
            engine.graphs = graphs
        return out
    finally:
        del engine
        free(device)


def attention(device: str, config: dict, bandwidth: float) -> dict:
    """The Triton kernels vs the gathering PyTorch path on the model's heads."""
    from triton_attention_bench import benchmark_decode_attention, benchmark_prefill_attention

    heads, kv_heads, head_dim = (config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    out = {"bandwidth_gbps": bandwidth, "decode": {}}
    for batch in (1, 32, 128):
        row = benchmark_decode_attention(batch, 4096, heads, kv_heads, head_dim, device=device)
        out["decode"][str(batch)] = row
        report(f"decode attention batch {batch} x 4096 (Triton; torch {row['torch_gbps']:.0f} GB/s)",
               row["triton_gbps"], bandwidth, "GB/s", row["triton_gbps"] / bandwidth)
    out["prefill"] = benchmark_prefill_attention(2048, 4096, heads, kv_heads, head_dim, device=device)
    report("prefill attention 2048 behind 2048 (Triton; torch "
           f"{out['prefill']['torch_tflops']:.0f} TFLOP/s)", out["prefill"]["triton_tflops"], unit="TFLOP/s")
    return out


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def ipc_copy(device: str, shape: dict) -> dict:
    """The 8B shape's KV copied by CUDA IPC from another process vs a device copy."""
    import ipc_bench

    out, gpu = {}, device if ":" in device else "cuda:0"
    for n in shape["handoff_sizes"]:
        row = ipc_bench.ipc_copy_benchmark(n, device=gpu)
        out[str(n)] = row
        report(f"CUDA IPC copy of {n} tokens' KV ({row['kv_bytes'] / 2**20:.0f} MiB)", row["ipc_gbps"],
               row["d2d_gbps"], "GB/s", row["ipc_vs_d2d"])
        report(f"CUDA IPC copy of {n} tokens, time", row["ipc_ms"], unit="ms")
    out["check"] = ipc_bench.two_process_check(gpu)
    report("CUDA IPC two-process check", out["check"])
    return out


def handoff_1p1d(dep: S.Deployment, device: str, shape: dict, config: dict) -> dict:
    """KV bytes, hand-off ms and GB/s of real PD requests, per prompt size, vs a device
    copy of the same bytes."""
    out = {}
    for n in shape["handoff_sizes"]:
        prompts = S.seeded_prompts(shape["handoff_reps"] + 1, n, config["vocab_size"], seed=10 + n)
        results = []
        for i, prompt in enumerate(prompts):  # one at a time: each hand-off alone; the first warms up
            (res,) = asyncio.run(S.run_trace(dep.url, [(0.0, prompt, 2, "handoff")], 600))
            if "error" in res:
                raise RuntimeError(f"request failed: {res['error']}")
            if i:
                results.append(dep.trace(res["id"]))
        copy_ms = [r["kv_fetch_ms"] + r["kv_import_ms"] for r in results]
        kv_bytes = results[0]["kv_bytes"]
        buf = torch.empty(int(kv_bytes), dtype=torch.uint8, device=device)
        dst = torch.empty_like(buf)
        d2d_ms = median_ms(lambda: dst.copy_(buf), device, repeats=10)
        row = {"kv_bytes": kv_bytes, "kv_tcp": max(r.get("kv_tcp", 0.0) for r in results),
               "handoff_ms": S.percentiles([r["kv_transfer_ms"] for r in results]),
               "export_ms": S.percentiles([r["kv_export_ms"] for r in results]),
               "copy_ms": S.percentiles(copy_ms), "d2d_ms": d2d_ms}
        row["gbps"] = kv_bytes / row["copy_ms"]["p50"] / 1e6
        row["d2d_gbps"] = kv_bytes / d2d_ms / 1e6
        row["vs_d2d"] = row["gbps"] / row["d2d_gbps"]
        out[str(n)] = row
        report(f"1P1D hand-off of {n} tokens ({kv_bytes / 2**20:.1f} MiB), p50", row["handoff_ms"]["p50"], unit="ms")
        report(f"1P1D KV copy of {n} tokens (fetch + import)", row["gbps"], row["d2d_gbps"], "GB/s", row["vs_d2d"])
    return out


def bursty_trace(shape: dict, config: dict) -> list[tuple[float, list[int], int, str]]:
    """32 chats starting over the first 0.5 s, and a few long prompts arriving 1 s apart
    from 1 s on (while the chats decode)."""
    chats = S.seeded_prompts(shape["chats"], shape["chat_prompt"], config["vocab_size"], seed=20)
    longs = S.seeded_prompts(shape["long_prompts"], shape["long_len"], config["vocab_size"], seed=21)
    return ([(0.5 * i / len(chats), p, shape["chat_tokens"], "chat") for i, p in enumerate(chats)]
            + [(1.0 + i, p, shape["long_tokens"], "long") for i, p in enumerate(longs)])


def served(results: dict, device: str, shape: dict, model_dir: Path, config: dict, workdir: Path,
           save, deadline: float) -> None:
    """``handoff_1p1d`` and ``bursty`` (pd, then colocated): each guarded on its own."""
    extra = ["--kv-cache-memory-mb", str(shape["serve_kv_mb"]), "--max-num-seqs", "64", "--no-enable-prefix-caching"]
    trace = bursty_trace(shape, config)
    bursty = results.setdefault("bursty", {"ok": None, "trace": {
        "chats": shape["chats"], "chat_prompt": shape["chat_prompt"], "chat_tokens": shape["chat_tokens"],
        "long_prompts": shape["long_prompts"], "long_len": shape["long_len"], "long_tokens": shape["long_tokens"]}})
    try:
        with S.Deployment("pd", model_dir, workdir, device, extra) as dep:
            guarded(results, "handoff_1p1d", lambda: handoff_1p1d(dep, device, shape, config), save, deadline)
            guarded(bursty, "pd", lambda: S.latency_summary(asyncio.run(S.run_trace(dep.url, trace, 600))),
                    save, deadline)
        with S.Deployment("colocated", model_dir, workdir, device, extra) as dep:
            guarded(bursty, "colocated",
                    lambda: S.latency_summary(asyncio.run(S.run_trace(dep.url, trace, 600))), save, deadline)
        bursty["ok"] = all(bursty.get(k, {}).get("ok") for k in ("pd", "colocated"))
    except Exception:
        bursty.update(ok=False, error=traceback.format_exc()[-3000:])
        results.setdefault("handoff_1p1d", {"ok": False, "error": "the pd deployment did not start"})
    for mode in ("pd", "colocated"):
        summary = bursty.get(mode, {})
        for kind in ("chat", "long"):
            for metric in ("ttft_ms", "itl_ms"):
                p = summary.get(kind, {}).get(metric, {})
                if p.get("n"):
                    report(f"bursty {mode} {kind} {metric} p50/p95/p99",
                           f"{p['p50']:.1f} / {p['p95']:.1f} / {p['p99']:.1f}")
    save()


def guarded(results: dict, name: str, run, save, deadline: float) -> None:
    """``results[name]`` = ``run()`` with ``ok: True``, or the error (or the budget's skip)."""
    if time.monotonic() > deadline:
        results[name] = {"ok": None, "skipped": "--budget-s spent"}
    else:
        start = time.monotonic()
        tqdm.write(f"[{name}]")
        try:
            results[name] = {"ok": True, **run()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            tqdm.write(f"  {name} FAILED:\n{results[name]['error']}")
        results[name]["seconds"] = time.monotonic() - start
    save()


def goals(results: dict) -> list[dict]:
    """The GPU check's goals with the values this run measured (None: not measured)."""
    out = []
    for name, path, op, target in GOALS:
        value = results
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        met = None if value is None else {">=": value >= target, "<=": value <= target, "==": value == target}[op]
        out.append({"goal": name, "json": ".".join(path), "value": value, "target": f"{op} {target}", "met": met})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--output", default="results/gpu_check.json", help="the JSON written")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU run of every section)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="sections that would start after this many seconds are skipped (default 450)")
    parser.add_argument("--workdir", default=None, help="where the model directories go (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch.cuda.is_available() is False (use --device cpu --smoke)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, shape = args.device, SMOKE if args.smoke else FULL
    config = S.TINY if args.smoke else S.LLAMA_8B
    deadline = time.monotonic() + args.budget_s
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"meta": {
        "device": device, "smoke": args.smoke, "torch": torch.__version__, "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "model_shape": {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_key_value_heads",
                                               "intermediate_size", "vocab_size")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}

    def save() -> None:
        results["goals"] = goals(results)
        output.write_text(json.dumps(results, indent=1, default=str))

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        workdir = Path(tmp)
        steps = tqdm(total=8, desc="gpu_check", unit="section")
        guarded(results, "ceilings", lambda: ceilings(device, shape), save, math.inf)
        steps.update()
        guarded(results, "parity", lambda: parity(device, shape, workdir), save, deadline)
        guarded(results, "tensor_parallel", lambda: T.tensor_parallel(device, shape, config, workdir), save, deadline)
        steps.update(2)
        model_dir = workdir / "llama-8b-shape"
        guarded(results, "model", lambda: {"path": str(S.write_llama_dir(model_dir, config, device))}, save, deadline)
        ceiling = results["ceilings"] if results["ceilings"].get("ok") else None
        if ceiling and results["model"].get("ok"):
            guarded(results, "throughput", lambda: throughput(device, shape, model_dir, config, ceiling), save,
                    deadline)
        else:
            results["throughput"] = {"ok": None, "skipped": "needs the ceilings and the model directory"}
        steps.update()
        if device.startswith("cuda") and ceiling:
            guarded(results, "attention", lambda: attention(device, config, ceiling["bandwidth_gbps"]), save,
                    deadline)
            guarded(results, "ipc_copy", lambda: ipc_copy(device, shape), save, deadline)
        else:
            results["attention"] = results["ipc_copy"] = {"ok": None, "skipped": "CUDA only"}
        steps.update(2)
        if results["model"].get("ok") and time.monotonic() < deadline:
            served(results, device, shape, model_dir, config, workdir, save, deadline)
        else:
            why = "--budget-s spent" if results["model"].get("ok") else "no model directory"
            results.update(handoff_1p1d={"ok": None, "skipped": why}, bursty={"ok": None, "skipped": why})
            save()
        steps.update(2)
        steps.close()
    for goal in results["goals"]:
        tqdm.write(f"goal {goal['goal']} ({goal['json']}): {goal['value']} {goal['target']} -> {goal['met']}")
    tqdm.write(f"wrote {output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
