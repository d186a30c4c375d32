"""Where one decode step's time goes at batch 32, per dtype: the scheduler, building the
input tensors, the forward pass, sampling, the engine's bookkeeping, and what the worker
adds per step (one ``Output`` message per request, msgpack-encoded).

One engine in this process (``--threads`` torch threads, default 1) gets ``--batch``
requests of ``--prompt-len`` random tokens, prefills them, and then runs ``--steps``
decode steps under ``cProfile``; each phase is the cumulative time of its function
(``Scheduler.schedule``, ``runner.prepare``, ``LlamaModel.forward``, ``sample``), and
"python overhead" is everything in the step that is neither the forward pass nor
sampling, plus the Output messages. The same run repeats per ``--dtypes`` and, for
float32, per ``--weight-formats`` (``epdserve/model/linear.py``: ``f32`` dense weights,
``q4_1`` the GGUF's blocks, ``bf16``, ``q4_1+f32``, ...; a bfloat16 model runs ``bf16``)
and reports each run's step time against the first run's and its greedy tokens'
agreement with them. The top torch operators of the forward pass come from
``torch.profiler``.

    .venv/bin/python benchmarks/engine_step.py [--batch 32] [--dtypes float32 bfloat16]
        [--weight-formats f32 q4_1]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import engine_limits  # benchmarks/
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model import step_budget
from epdserve.model.loader import resolve_model
from epdserve.model.linear import WEIGHT_FORMATS
from epdserve.serving import protocol as P

PHASES = {"schedule": "schedule", "prepare": "prepare", "forward": "forward", "sample": "sample"}


def decode_ready_engine(model_dir: str, dtype: str, weight_format: str, batch: int, prompt_len: int,
                        steps: int) -> LLMEngine:
    """An engine holding ``batch`` requests that have finished their prefill.

    Raises:
        ValueError: a weight format the model cannot hold (``linear.resolve``).
    """
    # The requests prefilled first decode while the others prefill (steps of at least the smallest default budget):
    # enough tokens that all are still running when the timed steps start, and KV room for all (no preemption).
    prefill_steps = -(-batch * prompt_len // max(step_budget.LIMITS[0] - batch, 1)) + 1
    sampling = SamplingParams(max_tokens=steps + 2 + prefill_steps, temperature=0, ignore_eos=True)
    per_token = engine_limits.kv_bytes_per_token(engine_limits.model_config(model_dir), 4)  # float32: the most
    kv_mb = max(512, 2 * batch * (prompt_len + sampling.max_tokens) * per_token // 2**20)
    engine = LLMEngine(model_dir, EngineConfig(dtype=dtype, kv_cache_memory_mb=kv_mb, weight_format=weight_format))
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(0, engine.model.config.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(str(i), prompt, sampling)
    while any(seq.is_prefilling for seq in engine.seqs.values()):
        engine.step()
    assert len(engine.scheduler.running) == batch, "a request finished or was preempted before the timed steps"
    return engine


def profile_steps(engine: LLMEngine, steps: int) -> tuple[dict[str, float], dict[str, list[int]]]:
    """ms per decode step of each phase (cProfile cumulative times) and the tokens made."""
    tokens: dict[str, list[int]] = {}
    outputs = []
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        outputs = engine.step()
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    profiler.disable()
    wall = (time.perf_counter() - start) / steps * 1e3
    stats = pstats.Stats(profiler).stats
    ms = {name: 0.0 for name in PHASES}
    for (_, _, func), (_, _, _, cumtime, _) in stats.items():
        for name, target in PHASES.items():
            if func == target:
                ms[name] += cumtime / steps * 1e3
    ms["step"] = wall
    encode_start = time.perf_counter()
    for out in outputs:
        P.encode(P.Output(worker_id="w", request_id=out.request_id, token_ids=out.token_ids))
    ms["outputs"] = (time.perf_counter() - encode_start) * 1e3
    ms["python overhead"] = ms["step"] - ms["forward"] - ms["sample"] + ms["outputs"]
    return ms, tokens


def top_ops(engine: LLMEngine, n: int) -> str:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--weight-formats", nargs="+", default=["f32"], choices=WEIGHT_FORMATS[1:],
                        help="float32 runs: one per weight format (bfloat16 runs: bf16)")
    parser.add_argument("--top-ops", type=int, default=8, help="torch operators to list (0: none)")
    args = parser.parse_args()
    if min(args.batch, args.prompt_len, args.steps, args.threads) < 1:
        parser.error("--batch, --prompt-len, --steps and --threads must be at least 1")
    # (label, dtype, weight format): a bfloat16 model holds bfloat16 weights only.
    runs = [(f"{dtype} {fmt}", dtype, fmt) for dtype in args.dtypes
            for fmt in (args.weight_formats if dtype == "float32" else ["bf16"])]
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(None).path)
    rows, reference = {}, None
    for label, dtype, fmt in runs:
        print(f"{label}: prefilling {args.batch} × {args.prompt_len} tokens…", flush=True)
        try:
            engine = decode_ready_engine(model_dir, dtype, fmt, args.batch, args.prompt_len, args.steps + 3)
        except ValueError as exc:
            parser.error(str(exc))
        ms, tokens = profile_steps(engine, args.steps)
        if reference is None:
            reference = tokens
        same = sum(a == b for rid in tokens for a, b in zip(tokens[rid], reference[rid]))
        ms["agreement"] = same / sum(len(t) for t in reference.values())
        rows[label] = ms
        if args.top_ops:
            print(top_ops(engine, args.top_ops))
    base = rows[runs[0][0]]["step"]
    print(f"\ndecode step at batch {args.batch}, context ~{args.prompt_len}, {args.threads} thread(s); ms per step")
    header = ["dtype, weights", "step", "vs " + runs[0][0], "tok/s", "forward", "sample", "schedule", "prepare",
              "outputs", "python overhead", "greedy agreement"]
    print(" | ".join(header))
    for label, ms in rows.items():
        print(" | ".join([label, f"{ms['step']:.1f}", f"{ms['step'] / base:.2f}×",
                          f"{args.batch / ms['step'] * 1e3:.0f}", f"{ms['forward']:.1f}", f"{ms['sample']:.2f}",
                          f"{ms['schedule']:.2f}", f"{ms['prepare']:.2f}", f"{ms['outputs']:.2f}",
                          f"{ms['python overhead']:.2f} ({ms['python overhead'] / ms['step']:.1%})",
                          f"{ms['agreement']:.1%}"]))


if __name__ == "__main__":
    main()
