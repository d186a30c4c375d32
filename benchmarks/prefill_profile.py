"""Where a prefill's time goes on this CPU: the GEMMs, attention, the small operators, the LM
head, sampling, the engine's own work, and the serving path around them.

One engine in this process (the engine ``epdserve serve --mode colocated`` runs: its default
config, ``--weight-format``, ``--threads`` torch threads, default every core of the run)
prefills ``--reps`` chat prompts of speed.py's workload (``--input-len`` text tokens plus
the chat template), one at a time, each with the first token sampled. Each part's time is
measured by wrapping the functions that run it with ``time.perf_counter`` (exclusive times:
a part nested in another counts only in itself; ~1 µs per call of overhead, ~300 calls a
prefill):

* GEMMs: the decoder layers' projections (``linear.Linear``: QKV, O, gate+up, down);
* attention: ``LlamaModel._attention`` (the way ``prefill_attention`` measured fastest);
* RMSNorm, RoPE + KV write: ``layer_ops.rms_norm`` (the final norm included, and the
  residual adds the norms carry), ``layer_ops.rope_write_kv``;
* SiLU x up, residuals, embedding: what the layers do besides the above
  (``LlamaModel._layer`` and ``hidden_states`` exclusive);
* LM head: the final row's logits (``LlamaModel.logits`` with its projection);
* sampling: ``engine.sample``;
* engine: the rest of ``LLMEngine.step`` (scheduling, input tensors, bookkeeping).

Then (unless ``--no-server``) ``epdserve serve`` colocated on the same cores gets the same
number of other prompts of the workload, one at a time, through the bench client (streamed
chat, 2 output tokens): its TTFT p50 minus the in-process
step's median is the serving path (HTTP, the router, tokenization, the worker's messages,
the first chunk). Each part is printed in ms (median over the reps; best in brackets) and as
a share of the served TTFT, with the CPU model and flags, and the GEMMs' GFLOP/s against
``engine_limits``'s float32 (or bfloat16) GEMM at the prompt's length.

    .venv/bin/python benchmarks/prefill_profile.py [--input-len 256] [--reps 8]
        [--weight-format auto] [--dtype float32] [--threads N] [--no-server] [--vllm]
        [--output results/prefill-profile]

``--vllm`` adds vLLM's split of the same prompts, from its own torch profiler
(``vllm_profile.py``).

With ``--output DIR``: ``DIR/prefill_profile.json`` and ``DIR/prefill_profile.png`` (one bar of
stacked parts per source: in-process, served).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import engine_limits  # benchmarks/
import speed_engines
import vllm_profile
from epdserve.engine import engine as engine_module
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model import layer_ops, linear
from epdserve.model.llama import LlamaModel
from epdserve.model.loader import resolve_model
from epdserve.model.tokenizer import chat_prompt_ids, load_tokenizer

PARTS = ("GEMMs", "attention", "RMSNorm", "RoPE + KV write", "SiLU x up, residuals, embedding", "LM head",
         "sampling", "engine")


class Timer:
    """Exclusive wall time per part of the functions :meth:`wrap` wraps (a part's nested
    calls count in their own parts, not in the caller's)."""

    def __init__(self):
        self.ms: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [part, start, time of nested calls]
        self.wrapped: list[tuple] = []  # (owner, name, the function wrapped)

    def wrap(self, owner, name: str, part) -> None:
        """Wrap ``owner.name`` (a function of a module or class); ``part``: a part name, or
        a function of the part of the calling frame (None at the top) giving it."""
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            outer = self.stack[-1][0] if self.stack else None
            this = part(outer) if callable(part) else part
            self.stack.append([this, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                p, t0, nested = self.stack.pop()
                took = time.perf_counter() - t0
                self.ms[p] += (took - nested) * 1e3
                if self.stack:
                    self.stack[-1][2] += took

        self.wrapped.append((owner, name, fn))
        setattr(owner, name, timed)

    def restore(self) -> None:
        """Put every wrapped function back."""
        for owner, name, fn in reversed(self.wrapped):
            setattr(owner, name, fn)
        self.wrapped.clear()


def instrument(timer: Timer) -> None:
    """Wrap the functions that run each of :data:`PARTS` (see the module doc)."""
    timer.wrap(LLMEngine, "step", "engine")
    timer.wrap(engine_module, "sample", "sampling")
    rest = "SiLU x up, residuals, embedding"
    timer.wrap(LlamaModel, "hidden_states", rest)
    timer.wrap(LlamaModel, "_layer", rest)
    timer.wrap(LlamaModel, "_attention", "attention")
    timer.wrap(LlamaModel, "logits", "LM head")
    timer.wrap(linear.Linear, "__call__", lambda outer: "LM head" if outer == "LM head" else "GEMMs")
    timer.wrap(layer_ops, "rms_norm", lambda outer: "LM head" if outer == "LM head" else "RMSNorm")
    timer.wrap(layer_ops, "rope_write_kv", "RoPE + KV write")


def in_process(model_dir: str, prompts: list[list[int]], weight_format: str, dtype: str) -> dict:
    """Prefill each of ``prompts[1:]`` (token ids) alone, the first token sampled, after an
    untimed warm-up prefill of ``prompts[0]``: per part, ``{"median_ms", "best_ms"}`` over
    them, the step's as ``"step"``; and ``weight_format``/``kernel_rows`` as the engine
    resolved them."""
    engine = LLMEngine(model_dir, EngineConfig(weight_format=weight_format, dtype=dtype))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    timer = Timer()
    instrument(timer)
    per_rep: list[dict[str, float]] = []
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
            timer.ms.clear()
            t0 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            per_rep.append({"step": (time.perf_counter() - t0) * 1e3, **timer.ms})
    finally:
        timer.restore()
    per_rep = per_rep[1:]  # the warm-up
    parts = {p: {"median_ms": statistics.median(r.get(p, 0.0) for r in per_rep),
                 "best_ms": min(r.get(p, 0.0) for r in per_rep)} for p in (*PARTS, "step")}
    return {"parts": parts, "weight_format": engine.model.weight_format.name,
            "kernel_rows": engine.model.kernel_rows, "prompt_tokens": statistics.mean(map(len, prompts[1:]))}


def served(requests, port: int, out_dir: Path, weight_format: str, dtype: str) -> dict:
    """``epdserve serve`` colocated (this run's cores), ``requests`` one at a time, its
    per-request trace in ``out_dir/epdserve.server.jsonl``: the client's TTFT p50 (ms), the
    medians of the trace's ``ttft_ms`` (the router's, from the request's arrival) and
    ``prefill_ms`` (the worker's, from scheduling to the first token), and what ``/health``
    said of the worker."""
    got = {}
    trace = (out_dir / "epdserve.server.jsonl").resolve()
    trace.unlink(missing_ok=True)
    extra = ["--trace-file", str(trace), "--dtype", dtype, "--weight-format", weight_format]
    health = speed_engines.run_server_engine(
        "epdserve", speed_engines.epdserve_command(port, None, extra), port, {1: requests}, out_dir, 300.0,
        lambda name, c, result: got.update(result))
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    records = [r for r in records if r.get("prompt_tokens", 0) > 100]  # not the bench client's warm-up
    return {"ttft_p50_ms": got["median_ttft_ms"],
            "router_ttft_p50_ms": statistics.median(r["ttft_ms"] for r in records),
            "worker_prefill_p50_ms": statistics.median(r["prefill_ms"] for r in records), "health": health}


def serving_parts(result: dict) -> dict[str, float]:
    """The served prefill's time outside the in-process step, ms (medians): in the worker
    (its trace's ``prefill_ms`` less the step: the worker's other threads, the router on the
    same cores), the router (its ``ttft_ms`` less ``prefill_ms``: tokenization, dispatch, the
    first token's way back) and HTTP (the client's TTFT less the router's); none without a
    served run."""
    srv = result.get("served")
    if not srv:
        return {}
    step = result["in_process"]["parts"]["step"]["median_ms"]
    return {"worker, beyond the step": srv["worker_prefill_p50_ms"] - step,
            "router": srv["router_ttft_p50_ms"] - srv["worker_prefill_p50_ms"],
            "HTTP and client": srv["ttft_p50_ms"] - srv["router_ttft_p50_ms"]}


def report(result: dict) -> list[str]:
    """The printed table of :func:`main`'s result."""
    inp, srv = result["in_process"], result.get("served")
    ttft = srv["ttft_p50_ms"] if srv else None
    lines = [f"{result['cpu']}, {result['threads']} threads, flags: {' '.join(result['cpu_flags'])}, "
             f"torch {result['torch']}",
             f"prefill of {inp['prompt_tokens']:.0f} tokens (weights {inp['weight_format']}, cut-over "
             f"{inp['kernel_rows']} rows), median over {result['reps']} prompts [best]"
             + (f"; served TTFT p50 {ttft:.1f} ms" if ttft else ""),
             f"  {'part':<32}{'ms':>9}{'[best]':>10}{'of TTFT' if ttft else '':>10}"]
    rows = [(p, inp["parts"][p]) for p in PARTS]
    for name, ms in serving_parts(result).items():
        rows.append((name, {"median_ms": ms, "best_ms": None}))
    for name, v in rows + [("in-process step", inp["parts"]["step"])]:
        best = "" if v["best_ms"] is None else f"[{v['best_ms']:.1f}]"
        share = f"{v['median_ms'] / ttft:.0%}" if ttft else ""
        lines.append(f"  {name:<32}{v['median_ms']:>9.1f}{best:>10}{share:>10}")
    g = result["gemm"]
    if "vllm" in result:
        v = result["vllm"]
        lines.append(f"vLLM, the same prompts one at a time (max_tokens 1; {v['request_ms_mean']:.1f} ms a request), "
                     "operators' self time from its torch profiler, ms per request:")
        lines += [f"  {part:<32}{ms:>9.1f}" for part, ms in sorted(v["parts"].items(), key=lambda kv: -kv[1])]
        lines += [f"    {name[:60]:<62}{part:<26}{ms:>8.2f}" for name, part, ms in v["top"]]
    lines.append(f"GEMMs: {g['gflop']:.1f} GFLOP in {inp['parts']['GEMMs']['median_ms']:.1f} ms = "
                 f"{g['gflops']:.0f} GFLOP/s, {g['share_of_ceiling']:.0%} of the {g['dtype']} GEMM ceiling "
                 f"({g['ceiling_gflops']:.0f} GFLOP/s at T={g['ceiling_tokens']}, benchmarks/engine_limits.py)")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inp, serving = result["in_process"], serving_parts(result)
    parts = list(PARTS) + list(serving)
    values = [inp["parts"][p]["median_ms"] for p in PARTS] + list(serving.values())
    fig, ax = plt.subplots(figsize=(9, 3.2))
    left = 0.0
    for name, v in zip(parts, values):
        ax.barh([0], [v], left=left, label=name)
        left += v
    ax.set_yticks([])
    ax.set_xlabel("ms (median per prefill)")
    ax.set_title(f"Prefill of {inp['prompt_tokens']:.0f} tokens, {result['cpu']}, {result['threads']} threads",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-len", type=engine_limits.positive_int, default=256, metavar="T")
    p.add_argument("--reps", type=engine_limits.positive_int, default=8, metavar="N")
    p.add_argument("--weight-format", default="auto", choices=linear.WEIGHT_FORMATS)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's dtype (serve's --dtype; bfloat16: activations and KV cache too)")
    p.add_argument("--threads", type=engine_limits.positive_int, default=engine_limits.default_threads(), metavar="N")
    p.add_argument("--port", type=engine_limits.positive_int, default=8310)
    p.add_argument("--no-server", action="store_true", help="the in-process profile only")
    p.add_argument("--vllm", action="store_true",
                   help="also vLLM's split of the same prompts, from its torch profiler (benchmarks/vllm_profile.py; "
                        "make vllm)")
    p.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="vllm serve --dtype for --vllm (bfloat16: against --weight-format q4_1+bf16 or --dtype bfloat16)")
    p.add_argument("--output", type=Path, default=None, metavar="DIR")
    args = p.parse_args(argv)
    if args.threads > engine_limits.default_threads():
        p.error(f"--threads {args.threads}: more than the {engine_limits.default_threads()} cores of this run")
    torch.set_num_threads(args.threads)
    info = resolve_model(None)
    tokenizer = load_tokenizer(info.path)
    traces = speed_engines.level_traces([1], args.reps + 1, args.input_len, 2, 0, tokenizer)[1]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": r.prompt}]) for r in traces[:args.reps + 1]]
    limits = engine_limits.measure(args.threads, info.path, tokens=(round(statistics.mean(map(len, prompts[1:]))),))
    print("\n".join(engine_limits.table(limits)), flush=True)
    result = {"cpu": limits["machine"], "cpu_flags": limits["cpu_flags"], "threads": args.threads,
              "torch": torch.__version__, "reps": args.reps, "input_len": args.input_len,
              "in_process": None}
    try:
        result["in_process"] = in_process(str(info.path), prompts, args.weight_format, args.dtype)
    except ValueError as exc:  # a weight format the dtype cannot hold (linear.resolve)
        p.error(str(exc))
    if not args.no_server:
        out_dir = args.output or Path("results/prefill-profile")
        out_dir.mkdir(parents=True, exist_ok=True)
        result["served"] = served(traces[1:args.reps + 1], args.port, out_dir, args.weight_format, args.dtype)
    if args.vllm:
        out_dir = args.output or Path("results/prefill-profile")
        out_dir.mkdir(parents=True, exist_ok=True)
        result["vllm"] = vllm_profile.run([r.prompt for r in traces[1:args.reps + 1]], info.path, info.name,
                                          args.port + 2, out_dir, speed_engines.default_vllm_bind(),
                                          dtype=args.vllm_dtype)
    inp = result["in_process"]
    dtype = "bfloat16" if "bf16" in inp["weight_format"] or args.dtype == "bfloat16" else "float32"
    tokens, ceiling = engine_limits.prefill_ceiling(limits, inp["prompt_tokens"], dtype)
    gflop = engine_limits.forward_flops(engine_limits.model_config(info.path), inp["prompt_tokens"]) / 1e9
    gflops = gflop / (inp["parts"]["GEMMs"]["median_ms"] / 1e3)
    result["gemm"] = {"gflop": gflop, "gflops": gflops, "dtype": dtype, "ceiling_tokens": tokens,
                      "ceiling_gflops": ceiling, "share_of_ceiling": gflops / ceiling}
    lines = report(result)
    print("\n" + "\n".join(lines))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "prefill_profile.json").write_text(json.dumps({**result, "table": lines}, indent=1))
        plot(result, args.output / "prefill_profile.png")
        print(f"written: {args.output / 'prefill_profile.json'}, {args.output / 'prefill_profile.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
