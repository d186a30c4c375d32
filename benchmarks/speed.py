"""Output throughput, TTFT and ITL of epdserve against llama.cpp's ``llama-server`` and
Hugging Face transformers, on the same model and the same prompts, in one run (issue 5
item 6; issue 4's "epdserve bench against llama-server").

Engines (``--engines``):

* ``epdserve``: ``epdserve serve --mode colocated`` (one worker on every core), started
  here on 127.0.0.1, driven by epdserve's bench client (:func:`epdserve.bench.run.bench`,
  closed loop of C clients: ``--max-concurrency C``, all requests due at t = 0);
* ``llama-server``: llama.cpp's server on the GGUF file epdserve loads by default, with
  ``--parallel 32 --threads 2 --cont-batching --jinja`` (the GGUF's own chat template, as
  epdserve uses) and a context of 32 slots x (prompt + output), driven by the same client
  against its OpenAI endpoint. The binary is built (``benchmarks/llama_build.py``) from
  the llama.cpp sources vendored in the ``llama-cpp-python`` sdist from PyPI, once, into
  ``~/.cache/epdserve/llama.cpp-VERSION/``;
* ``transformers`` (two rows): the float32 Hugging Face directory epdserve converted the
  GGUF into, ``AutoModelForCausalLM``:
  ``transformers-generate`` — ``generate`` on static batches of C prompts (left padding,
  greedy, ``min_new_tokens = max_new_tokens``: EOS ignored), one batch after another.
  Token times come from a stopping criterion, which ``generate`` calls once after every
  step (prefill, then each decode step): TTFT = first call − batch start, ITL = the gaps
  between calls, the same for every row of the batch (no streamer: transformers'
  streamers take batch size 1).
  ``transformers-cb`` — transformers' continuous batching (``init_continuous_batching``,
  ``ContinuousBatchingManager``) when the installed version has it: a closed loop of C
  requests in flight (a new one is added when one finishes), EOS disabled, per-token
  timestamps from ``record_timestamps``; TTFT from just before ``add_request``.

Workload: seeded synthetic chat prompts of ``--input-len`` tokens (text only; the chat
template adds its tokens on top), ``--output-len`` output tokens, greedy, EOS ignored.
Each concurrency level gets its own prompts (``--num-prompts``, default max(2C, 8)), so
no engine's prompt cache can reuse a prompt from an earlier level; every engine gets the
same ones. Metrics: :mod:`epdserve.bench.metrics` on every engine's per-request records
(the transformers rows build the same records), so definitions are identical.

Output: a table per concurrency (output tok/s, TTFT and ITL p50/p95, output tokens
checked against what was asked) with the ratios epdserve / llama-server and epdserve /
transformers-generate against the goals of issue 5, a greedy-agreement line (the first
prompt's text: epdserve vs transformers must match exactly, same float32 weights; vs
llama-server, Q4_1 compute, the common prefix length), and under ``--output DIR``:
``speed.json`` (settings, every engine's full bench result per level, agreement) and
``speed.png`` (throughput and ITL p50 against concurrency per engine); server logs too.

    .venv/bin/python benchmarks/speed.py [--concurrency 1 8 32] [--num-prompts N] \\
        [--engines epdserve,llama-server,transformers] [--output results/speed] \\
        [--skip-build | --llama-server PATH] [--input-len 256] [--output-len 128]

Exit status: 0 when every engine ran, 1 when a build, a server or an engine failed
(the message says which and why), 130 on Ctrl-C. Servers are stopped in every case.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

from epdserve.bench import client, compare, datasets, metrics, workload
from epdserve.bench.processes import SERVE, ServerError, ServerProcess, port_is_free
from epdserve.bench.run import bench, write_json
from llama_build import (LLAMA_CPP_PYTHON_VERSION, BuildError, build_llama_server,  # benchmarks/
                         default_cache_dir)

LLAMA_PARALLEL = 32  # llama-server slots (issue 5: "--parallel 32 and 2 threads")
LLAMA_THREADS = 2
ENGINES = ("epdserve", "llama-server", "transformers")
# Chat-template tokens around a user message (SmolLM2's template with its default system
# prompt is ~30); a llama-server slot must hold them as well as the prompt and output.
TEMPLATE_MARGIN = 64


# ---------------------------------------------------------------------------------------
# Workload


def level_traces(concurrency: list[int], num_prompts: int | None, input_len: int,
                 output_len: int, seed: int, tokenizer) -> dict[int, list[workload.Request]]:
    """Disjoint prompts per concurrency level (all due at t = 0: a closed loop of C),
    cut from one seeded synthetic trace, so every engine gets the same prompts and no
    prompt of one level is in a prompt cache filled by an earlier level."""
    counts = [num_prompts or max(2 * c, 8) for c in concurrency]
    trace = datasets.synthetic(tokenizer, num_prompts=sum(counts), input_len=(input_len, input_len),
                               output_len=(output_len, output_len), seed=seed)
    out, start = {}, 0
    for c, n in zip(concurrency, counts):
        out[c] = trace[start:start + n]
        start += n
    return out


def client_args(concurrency: int, timeout_s: float) -> Namespace:
    """The options :func:`epdserve.bench.run.bench` reads, as ``epdserve bench`` would set
    them: chat endpoint, greedy, ignore_eos, one warm-up request, closed loop of C, a
    progress bar."""
    return Namespace(endpoint="chat", temperature=0.0, ignore_eos=True, disable_tqdm=False,
                     request_timeout=timeout_s, warmup=1, warmup_requests=0,
                     max_concurrency=concurrency, goodput=None, request_rate=float("inf"))


# ---------------------------------------------------------------------------------------
# Engines behind an OpenAI endpoint


def run_server_engine(name: str, cmd: list[str], port: int, traces: dict, out_dir: Path,
                      startup_timeout_s: float, record) -> None:
    """Start ``cmd`` (its own process group, log ``out_dir/NAME.log``), wait for
    ``/health`` 200, run every level's trace with the bench client, passing each result
    to ``record(NAME, C, bench result)``, stop the server (also on errors and Ctrl-C).

    Raises:
        ServerError: the port is taken, or the server did not come up.
        client.ClientError: it stopped answering or the warm-up failed.
    """
    if not port_is_free(port):
        raise ServerError(f"{name}: port {port} on 127.0.0.1 is in use; pass --port")
    server = ServerProcess(name, cmd, out_dir / f"{name}.log", f"http://127.0.0.1:{port}")
    print(f"[{name}] starting: {' '.join(cmd)}", flush=True)
    try:
        server.start()
        took = server.wait_healthy(startup_timeout_s)
        print(f"[{name}] healthy after {took:.1f} s", flush=True)
        for c, requests in traces.items():
            record(name, c, bench(server.base_url, requests, client_args(c, 600.0)))
    finally:
        server.stop()


def epdserve_command(port: int, model: str | None) -> list[str]:
    cmd = [*SERVE, "--mode", "colocated", "--workers", "1", "--host", "127.0.0.1",
           "--port", str(port)]
    return cmd + (["--model", model] if model else [])


def llama_server_command(binary: Path, gguf: str, port: int, slot_tokens: int) -> list[str]:
    """``llama-server`` on ``gguf`` with :data:`LLAMA_PARALLEL` slots of ``slot_tokens``
    each (the context is split evenly among slots when ``--parallel`` is given)."""
    return [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--alias", Path(gguf).name.split(".")[0],
            "--parallel", str(LLAMA_PARALLEL), "--threads", str(LLAMA_THREADS),
            "--threads-batch", str(LLAMA_THREADS), "--ctx-size", str(LLAMA_PARALLEL * slot_tokens),
            "--cont-batching", "--jinja", "--no-webui"]


# ---------------------------------------------------------------------------------------
# transformers


def _records_from_times(reqs: list[workload.Request], t0s: list[float], times: list[list[float]],
                        texts: list[str], prompt_lens: list[int], run_start: float
                        ) -> list[client.RequestRecord]:
    """Client-style records (seconds, see :class:`epdserve.bench.client.RequestRecord`)
    from each request's start ``t0s`` and token times (``time.perf_counter``)."""
    out = []
    for i, (req, t0, ts) in enumerate(zip(reqs, t0s, times)):
        rel = [t - t0 for t in ts]
        out.append(client.RequestRecord(
            index=i, max_tokens=req.max_tokens, expected_prompt_tokens=req.prompt_tokens,
            start_s=t0 - run_start, chunk_times_s=rel, last_chunk_s=rel[-1],
            end_s=ts[-1] - run_start, usage_prompt_tokens=prompt_lens[i],
            usage_completion_tokens=len(ts), generated_text=texts[i], success=True))
    return out


class Transformers:
    """The float32 HF model epdserve converted the GGUF into, on ``threads`` CPU threads."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def prompt_ids(self, req: workload.Request) -> list[int]:
        """Token ids of ``req`` as a chat with one user message (the tokenizer's chat
        template, as epdserve's /v1/chat/completions applies it)."""
        text = self.tok.apply_chat_template([{"role": "user", "content": req.prompt}],
                                            add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def generate(self, requests: list[workload.Request], concurrency: int
                 ) -> list[client.RequestRecord]:
        """Static batches of ``concurrency`` requests, one after another (see module doc)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch

        class StepTimes(StoppingCriteria):
            """Called by ``generate`` after every step; records when, never stops."""

            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        records, run_start = [], time.perf_counter()
        for b in range(0, len(requests), concurrency):
            batch = requests[b:b + concurrency]
            ids = [self.prompt_ids(r) for r in batch]
            width = max(map(len, ids))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            n_out = batch[0].max_tokens
            steps = StepTimes()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                          max_new_tokens=n_out, min_new_tokens=n_out,
                                          do_sample=False, pad_token_id=pad,
                                          stopping_criteria=StoppingCriteriaList([steps]))
            texts = self.tok.batch_decode(out[:, width:], skip_special_tokens=True)
            records += _records_from_times(batch, [t0] * len(batch), [steps.times] * len(batch),
                                           texts, [len(x) for x in ids], run_start)
        return records

    def continuous_batching(self, requests: list[workload.Request], concurrency: int
                            ) -> list[client.RequestRecord]:
        """Closed loop of ``concurrency`` requests through transformers' continuous
        batching manager (see module doc).

        Raises:
            RuntimeError: a request failed inside the manager (its error message).
        """
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        n_out = requests[0].max_tokens
        ids = [self.prompt_ids(r) for r in requests]
        # A KV cache sized for C requests in flight (without num_blocks it is sized from
        # free memory, GPU-style); eos_token_id -1 disables EOS, as vLLM's ignore_eos.
        page = 256
        blocks = concurrency * (-(-(max(map(len, ids)) + n_out) // page) + 1)
        manager = self.model.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=n_out, do_sample=False,
                                               eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=page, num_blocks=blocks, max_requests_per_batch=concurrency))
        t0s: dict[str, float] = {}  # request id -> just before add_request; one per sent
        done: dict[str, object] = {}
        manager.start()
        try:
            run_start = time.perf_counter()

            def submit(i: int) -> None:
                t0s[f"r{i}"] = time.perf_counter()
                manager.add_request(ids[i], request_id=f"r{i}", max_new_tokens=n_out,
                                    record_timestamps=True)

            for i in range(min(concurrency, len(requests))):
                submit(i)
            while len(done) < len(requests):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers continuous batching: the generation "
                                           "thread stopped")
                    continue
                if not result.is_finished():
                    continue
                if result.error:
                    raise RuntimeError(f"transformers continuous batching: {result.error}")
                done[result.request_id] = result
                if len(t0s) < len(requests):
                    submit(len(t0s))
        finally:
            manager.stop(block=True, timeout=30)
        results = [done[f"r{i}"] for i in range(len(requests))]
        texts = self.tok.batch_decode([r.generated_tokens for r in results],
                                      skip_special_tokens=True)
        return _records_from_times(requests, [t0s[f"r{i}"] for i in range(len(requests))],
                                   [r.timestamps for r in results], texts,
                                   [len(x) for x in ids], run_start)


def has_continuous_batching(model) -> bool:
    """Whether this transformers version has the continuous-batching API on its models."""
    return hasattr(model, "init_continuous_batching")


def run_transformers(model_dir: Path, traces: dict, threads: int, record) -> None:
    """Measure ``transformers-generate`` and, when the API exists, ``transformers-cb`` on
    every level, each after one unmeasured warm-up call; pass each result (the dict of
    :func:`epdserve.bench.metrics.compute`) to ``record(NAME, C, result)``."""
    engine = Transformers(model_dir, threads)
    runs = {"transformers-generate": engine.generate}
    if has_continuous_batching(engine.model):
        runs["transformers-cb"] = engine.continuous_batching
    else:
        print("[transformers] this version has no continuous-batching API "
              "(init_continuous_batching); only generate is measured", flush=True)
    warm = [workload.Request(0.0, client.WARMUP_PROMPT, client.WARMUP_MAX_TOKENS, "chat", 0)]
    for name, fn in runs.items():
        fn(warm, 1)
        for c, requests in traces.items():
            result = metrics.compute(fn(requests, c))
            result["max_concurrency"] = c
            record(name, c, result)


# ---------------------------------------------------------------------------------------
# Report


def _brief(result: dict) -> str:
    return (f"{result['completed']} ok, {result['failed']} failed, "
            f"{result['output_throughput']:.1f} out tok/s, TTFT p50 "
            f"{result['median_ttft_ms']:.0f} ms, ITL p50 {result['median_itl_ms']:.1f} ms")


def output_check(result: dict, asked: int) -> str:
    """"ok" when every request got ``asked`` output tokens (usage.completion_tokens, or
    chunks), else the lengths seen; failures show as "N failed"."""
    if result["failed"]:
        return f"{result['failed']} failed"
    lens = sorted(set(result["output_lens"]))
    return "ok" if lens == [asked] else "lens " + ",".join(map(str, lens))


def table(results: dict[str, dict[int, dict]], concurrency: list[int], asked: int) -> list[str]:
    """Per concurrency: one row per engine and the ratios against the issue's goals."""
    lines = []
    for c in concurrency:
        if not any(c in per_c for per_c in results.values()):
            continue
        lines.append(f"\nconcurrency {c}")
        lines.append(f"  {'engine':<22}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p95':>10}"
                     f"{'ITL p50':>9}{'ITL p95':>9}{'prompt tok':>11}  output lens")
        for name, per_c in results.items():
            r = per_c.get(c)
            if r is None:
                continue
            prompt = r["total_input_tokens"] / r["completed"] if r["completed"] else 0
            lines.append(f"  {name:<22}{r['output_throughput']:>10.1f}{r['median_ttft_ms']:>10.0f}"
                         f"{r['p95_ttft_ms']:>10.0f}{r['median_itl_ms']:>9.1f}"
                         f"{r['p95_itl_ms']:>9.1f}{prompt:>11.0f}  {output_check(r, asked)}")
        ours = results.get("epdserve", {}).get(c)
        for other, goal in (("llama-server", 1.0), ("transformers-generate", 3.0)):
            theirs = results.get(other, {}).get(c)
            if ours and theirs and theirs["output_throughput"] > 0:
                ratio = ours["output_throughput"] / theirs["output_throughput"]
                # issue 5's goals: >= llama-server at C=1 and C=32, >= 3x generate at C=32
                applies = (other == "llama-server" and c in (1, 32)) or c == 32
                verdict = (f"  (goal >= {goal:g}x: {'met' if ratio >= goal else 'MISSED'})"
                           if applies else "")
                lines.append(f"  epdserve / {other}: {ratio:.2f}x output tok/s{verdict}")
    return lines


def common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(results: dict[str, dict[int, dict]], level: int) -> dict:
    """The first prompt of level ``level``: epdserve's greedy text against the others'
    (``{"OTHER": {"exact", "common_prefix_chars", "chars"}}``)."""
    ours = results.get("epdserve", {}).get(level)
    if not ours or ours["errors"][0]:
        return {}
    text = ours["generated_texts"][0]
    out = {}
    for name, per_c in results.items():
        theirs = per_c.get(level)
        if name == "epdserve" or not theirs or theirs["errors"][0]:
            continue
        other = theirs["generated_texts"][0]
        out[name] = {"exact": other == text, "common_prefix_chars": common_prefix(text, other),
                     "chars": [len(text), len(other)]}
    return out


def plot(results: dict[str, dict[int, dict]], path: Path) -> None:
    """Output tok/s and ITL p50 against concurrency, one line per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = sorted({c for per_c in results.values() for c in per_c})
    for name, per_c in results.items():
        cs = sorted(per_c)
        ax1.plot(cs, [per_c[c]["output_throughput"] for c in cs], marker="o", label=name)
        ax2.plot(cs, [per_c[c]["median_itl_ms"] for c in cs], marker="o", label=name)
    for ax, title, unit in ((ax1, "Output throughput", "tokens/s"),
                            (ax2, "ITL p50", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ENGINES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {','.join(ENGINES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=parse_engines, default=list(ENGINES),
                   help="comma list of epdserve,llama-server,transformers (default all)")
    p.add_argument("--concurrency", type=workload.positive_int, nargs="+", default=[1, 8, 32],
                   metavar="C", help="requests in flight per level (default 1 8 32)")
    p.add_argument("--num-prompts", type=workload.positive_int, default=None, metavar="N",
                   help="requests per level (default max(2C, 8))")
    p.add_argument("--input-len", type=workload.positive_int, default=256, metavar="T",
                   help="prompt tokens, chat template not counted (default 256)")
    p.add_argument("--output-len", type=workload.positive_int, default=128, metavar="T",
                   help="output tokens, EOS ignored (default 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/speed", metavar="DIR",
                   help="speed.json, speed.png and server logs go here (default results/speed)")
    p.add_argument("--model", default=None, metavar="GGUF",
                   help="GGUF file (default: the one epdserve loads by default)")
    p.add_argument("--port", type=workload.positive_int, default=8300,
                   help="epdserve's port; llama-server takes the next one (default 8300)")
    p.add_argument("--threads", type=workload.positive_int, default=2,
                   help="torch threads for transformers (default 2, like llama-server)")
    b = p.add_argument_group("llama-server binary")
    b.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                   help="use this llama-server binary instead of building one")
    b.add_argument("--skip-build", action="store_true",
                   help="use the cached build; fail if there is none")
    b.add_argument("--llama-cpp-python-version", default=LLAMA_CPP_PYTHON_VERSION, metavar="V",
                   help="sdist whose vendored llama.cpp is built (default %(default)s)")
    b.add_argument("--sdist", type=Path, default=None, metavar="FILE",
                   help="a local llama-cpp-python sdist (default: cached, else pip download)")
    b.add_argument("--build-jobs", type=workload.positive_int, default=2, metavar="N")
    b.add_argument("--startup-timeout", type=float, default=300.0, metavar="S")
    args = p.parse_args(argv)

    from epdserve.model.loader import ModelLoadError, resolve_model

    signal.signal(signal.SIGTERM, compare._raise_interrupt)  # stop servers on kill too
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrency = sorted(set(args.concurrency))
    try:
        info = resolve_model(args.model)
        binary = None
        if "llama-server" in args.engines:
            if args.llama_server is not None:
                binary = args.llama_server
                if not os.access(binary, os.X_OK):
                    raise BuildError(f"--llama-server {binary}: not an executable file")
            else:
                cache = default_cache_dir(args.llama_cpp_python_version)
                if args.skip_build and not (cache / "build" / "bin" / "llama-server").is_file():
                    raise BuildError(f"--skip-build: no cached build in {cache}; drop "
                                     f"--skip-build or pass --llama-server PATH")
                binary = build_llama_server(args.llama_cpp_python_version, cache, args.sdist,
                                            args.build_jobs)
        from epdserve.model.tokenizer import load_tokenizer

        traces = level_traces(concurrency, args.num_prompts, args.input_len, args.output_len,
                              args.seed, load_tokenizer(info.path))
    except (BuildError, ModelLoadError, workload.TraceError) as exc:
        print(f"speed: error: {exc}", file=sys.stderr)
        return 1

    results: dict[str, dict[int, dict]] = {}
    failures: dict[str, str] = {}
    settings = {"concurrency": concurrency, "num_prompts": {c: len(t) for c, t in traces.items()},
                "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                "temperature": 0.0, "ignore_eos": True, "model_gguf": info.source,
                "model_hf_dir": str(info.path), "cpus": os.cpu_count(),
                "machine": platform.processor() or platform.machine()}
    slot = args.input_len + args.output_len + TEMPLATE_MARGIN
    slot = -(-slot // 256) * 256
    if binary is not None:
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        settings["llama_server"] = {"binary": str(binary), "parallel": LLAMA_PARALLEL,
                                    "threads": LLAMA_THREADS, "ctx_size": LLAMA_PARALLEL * slot,
                                    "version": (version.stdout + version.stderr).strip()[-200:]}

    def record(name: str, c: int, result: dict) -> None:
        """Keep one engine's result at one level and save what exists so far, so that a
        run cut short keeps what it measured."""
        results.setdefault(name, {})[c] = result
        print(f"[{name}] C={c}: {_brief(result)}", flush=True)
        write_json({"settings": settings, "results": results, "failures": failures,
                    "partial": True}, out_dir / "speed.json")

    engine_runs = {
        "epdserve": lambda: run_server_engine(
            "epdserve", epdserve_command(args.port, args.model), args.port, traces, out_dir,
            args.startup_timeout, record),
        "llama-server": lambda: run_server_engine(
            "llama-server", llama_server_command(binary, info.source, args.port + 1, slot),
            args.port + 1, traces, out_dir, args.startup_timeout, record),
        "transformers": lambda: run_transformers(info.path, traces, args.threads, record),
    }
    try:
        for name in args.engines:
            try:
                engine_runs[name]()
            except (ServerError, client.ClientError, RuntimeError) as exc:
                failures[name] = str(exc)
                print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("speed: interrupted; servers stopped", file=sys.stderr)
        return 130

    lines = table(results, concurrency, args.output_len)
    agree = agreement(results, concurrency[0])
    if agree:
        lines.append(f"\ngreedy agreement, first prompt at C={concurrency[0]} (epdserve and "
                     f"transformers-cb generate past EOS as vLLM's ignore_eos does; generate's "
                     f"min_new_tokens and llama-server's ignore_eos mask EOS, so their text may "
                     f"part from the first point where EOS is the argmax):")
    for name, a in agree.items():
        lines.append(f"  epdserve vs {name}: " + (
            "identical text" if a["exact"] else
            f"common prefix {a['common_prefix_chars']} chars (texts {a['chars'][0]} and "
            f"{a['chars'][1]} chars)"))
    if "transformers" in args.engines and "transformers" not in failures \
            and "transformers-cb" not in results:
        lines.append("transformers continuous batching: not in this transformers version")
    for name, why in failures.items():
        lines.append(f"{name}: FAILED: {why.splitlines()[0]}")
    print("\n".join(lines))
    write_json({"settings": settings, "results": results, "agreement": agree,
                "failures": failures, "table": lines}, out_dir / "speed.json")
    if results:
        plot(results, out_dir / "speed.png")
    print(f"\nwritten: {out_dir / 'speed.json'}, {out_dir / 'speed.png'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
