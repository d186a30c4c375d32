"""Output throughput, TTFT and ITL of epdserve against llama.cpp's ``llama-server``, vLLM's
CPU build and Hugging Face transformers, on the same model and the same prompts, in one
run, each figure also read as a share of the machine's ceilings.

Engines (``--engines``; default epdserve, llama-server and transformers, plus vllm when
``make vllm`` has installed ``.venv-vllm``):

* ``epdserve``: ``epdserve serve --mode colocated`` (one worker on every core; ``--epdserve-args`` adds flags), started
  here on 127.0.0.1, driven by epdserve's bench client (:func:`epdserve.bench.run.bench`,
  closed loop of C clients: ``--max-concurrency C``, all requests due at t = 0);
* ``llama-server``: llama.cpp's server on the GGUF file epdserve loads by default, with
  ``--parallel 32 --threads 2 --cont-batching --jinja`` (the GGUF's own chat template, as
  epdserve uses) and a context of 32 slots x (prompt + output), driven by the same client
  against its OpenAI endpoint. The binary is built (``benchmarks/llama_build.py``) from
  the llama.cpp sources vendored in the ``llama-cpp-python`` sdist from PyPI, once, into
  ``~/.cache/epdserve/llama.cpp-VERSION/``;
* ``vllm``: ``.venv-vllm/bin/vllm serve DIR --dtype float32 --max-model-len 4096`` on the
  float32 Hugging Face directory epdserve serves (``resolve_model(...).path``), with
  ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and ``VLLM_CPU_OMP_THREADS_BIND`` from
  ``--vllm-bind`` (default: every core of the run, e.g. ``0-1``; ``auto``: vLLM's own,
  which leaves a core to its front end), driven by the same client. Its start takes ~2
  minutes here (compilation; a 60 s "No available shared memory broadcast block" pause is
  normal), waited for on ``/health`` up to ``--vllm-startup-timeout`` (600 s);
* ``transformers`` (two rows, ``benchmarks/speed_transformers.py``):
  ``transformers-generate`` (static batches of C prompts) and ``transformers-cb``
  (continuous batching, when the installed version has it), on the float32 directory.

Before the servers, ``benchmarks/engine_limits.py`` measures the machine's ceilings on the
engine's threads (every core this process may use): float32 GEMM GFLOP/s at the model's
prefill shapes (T = 256, 1024 and the chat prompt's length), memory copy and read GB/s,
and the bytes a decode step reads. Each engine's prefill (weight-matmul FLOPs of the
prompt over TTFT p50 at C=1) and decode (the roofline floor of a step of C sequences over
ITL p50) are printed as a share of those (``benchmarks/speed_ceilings.py``).

Workload: seeded synthetic chat prompts of ``--input-len`` tokens (text only; the chat
template adds its tokens on top), ``--output-len`` output tokens, greedy, EOS ignored.
Each concurrency level gets its own prompts (``--num-prompts``, default max(2C, 8)), so
no engine's prompt cache can reuse a prompt from an earlier level; every engine gets the
same ones. Metrics: :mod:`epdserve.bench.metrics` on every engine's per-request records
(the transformers rows build the same records), so definitions are identical.

Output: a table per concurrency (output tok/s, TTFT and ITL p50/p95, output tokens
checked against what was asked) with the ratios epdserve / llama-server and epdserve /
transformers-generate against epdserve's goals, epdserve / vllm (output tok/s, TTFT p50,
ITL p50 and p99), a greedy-agreement line (the first prompt's text: epdserve vs
transformers and vllm must match exactly, same float32 weights; vs llama-server, Q4_1
compute, the common prefix length), the ceilings section, and under ``--output DIR``:
``speed.json`` (settings, every engine's full bench result per level, agreement, the
ceilings and shares, epdserve / vllm) and ``speed.png`` (throughput and ITL p50 against
concurrency per engine); server logs too.

    .venv/bin/python benchmarks/speed.py [--concurrency 1 8 32] [--num-prompts N] \\
        [--engines epdserve,llama-server,transformers,vllm] [--output results/speed] \\
        [--skip-build | --llama-server PATH] [--input-len 256] [--output-len 128] \\
        [--vllm-bind 0-1|auto]

Exit status: 0 when every engine ran, 1 when a build, a server or an engine failed
(the message says which and why, and names the server's log), 130 on Ctrl-C. Servers are
stopped, their whole process groups, in every case.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import engine_limits  # benchmarks/
import speed_ceilings
import speed_engines as engines
from epdserve.bench import client, compare, workload
from epdserve.bench.processes import ServerError
from epdserve.bench.run import write_json
from llama_build import LLAMA_CPP_PYTHON_VERSION, BuildError, build_llama_server, default_cache_dir
from speed_report import agreement, brief, plot, table, vs_vllm
from speed_transformers import run_transformers

ENGINES = ("epdserve", "llama-server", "transformers", "vllm")


def default_engines() -> list[str]:
    """epdserve, llama-server and transformers; vllm too once ``make vllm`` finished."""
    return list(ENGINES) if engines.vllm_installed() else list(ENGINES[:3])


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in ENGINES for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {','.join(ENGINES)}")
    return names


def parse_bind(text: str) -> str:
    try:
        return engines.vllm_bind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=parse_engines, default=default_engines(),
                   help="comma list of epdserve,llama-server,transformers,vllm (default: the first "
                        "three, and vllm when .venv-vllm/.installed exists)")
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
                   help="epdserve's port; llama-server takes the next one, vllm the one after (default 8300)")
    p.add_argument("--threads", type=workload.positive_int, default=2,
                   help="torch threads for transformers (default 2, like llama-server)")
    p.add_argument("--epdserve-args", default="", metavar="FLAGS",
                   help="more flags for epdserve serve, one string, e.g. \"--weight-format q4_1+bf16\"")
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
    v = p.add_argument_group("vllm")
    v.add_argument("--vllm", type=Path, default=engines.VLLM_VENV / "bin" / "vllm", metavar="PATH",
                   help="the vllm command (default: .venv-vllm/bin/vllm, from `make vllm`)")
    v.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="vllm serve --dtype (default %(default)s: the same arithmetic as epdserve's default; "
                        "bfloat16 where the CPU has it natively, against epdserve's --weight-format q4_1+bf16 or "
                        "--dtype bfloat16 in --epdserve-args)")
    v.add_argument("--vllm-bind", type=parse_bind, default=engines.default_vllm_bind(), metavar="CPUS|auto",
                   help="VLLM_CPU_OMP_THREADS_BIND (default %(default)s: every core of this run; auto: "
                        "vLLM's default, a core left to its front end)")
    v.add_argument("--vllm-preload", nargs="+", default=[], metavar="LIB",
                   help="libraries vLLM gets in LD_PRELOAD, as its log recommends, e.g. "
                        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv-vllm/lib/libiomp5.so")
    v.add_argument("--vllm-startup-timeout", type=float, default=engines.VLLM_STARTUP_TIMEOUT_S, metavar="S",
                   help="seconds to wait for vllm's /health (default %(default)g)")
    return p.parse_args(argv)


def llama_binary(args: argparse.Namespace) -> Path | None:
    """The llama-server binary (built or cached) when the engine is asked for, else None.

    Raises:
        BuildError: no binary, or the build failed.
    """
    if "llama-server" not in args.engines:
        return None
    if args.llama_server is not None:
        if not os.access(args.llama_server, os.X_OK):
            raise BuildError(f"--llama-server {args.llama_server}: not an executable file")
        return args.llama_server
    cache = default_cache_dir(args.llama_cpp_python_version)
    if args.skip_build and not (cache / "build" / "bin" / "llama-server").is_file():
        raise BuildError(f"--skip-build: no cached build in {cache}; drop "
                         f"--skip-build or pass --llama-server PATH")
    return build_llama_server(args.llama_cpp_python_version, cache, args.sdist, args.build_jobs)


def settings_of(args, info, traces: dict, concurrency: list[int], binary: Path | None, slot: int) -> dict:
    """The run's settings as speed.json records them."""
    settings = {"concurrency": concurrency, "num_prompts": {c: len(t) for c, t in traces.items()},
                "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed,
                "temperature": 0.0, "ignore_eos": True, "model_gguf": info.source,
                "model_hf_dir": str(info.path), "cpus": os.cpu_count(),
                "machine": engine_limits.cpu_model(), "engines": args.engines,
                "epdserve_args": args.epdserve_args}
    if binary is not None:
        version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        settings["llama_server"] = {"binary": str(binary), "parallel": engines.LLAMA_PARALLEL,
                                    "threads": engines.LLAMA_THREADS,
                                    "ctx_size": engines.LLAMA_PARALLEL * slot,
                                    "version": (version.stdout + version.stderr).strip()[-200:]}
    if "vllm" in args.engines:
        settings["vllm"] = {"command": engines.vllm_command(args.vllm, info.path, info.name, args.port + 2,
                                                            args.vllm_dtype),
                            "env": engines.vllm_env(args.vllm_bind, args.vllm_preload)}
    return settings


def report_lines(args, concurrency: list[int], results: dict, failures: dict, limits: dict,
                 found: dict) -> tuple[list[str], dict]:
    """The printed report, and the greedy agreement it states."""
    lines = table(results, concurrency, args.output_len)
    agree = agreement(results, concurrency[0])
    if agree:
        lines.append(f"\ngreedy agreement, first prompt at C={concurrency[0]} (epdserve, vllm and "
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
    lines += speed_ceilings.lines(limits, found)
    for name, why in failures.items():
        lines.append(f"{name}: FAILED: {why.splitlines()[0]}")
    return lines, agree


def measure_limits(model_dir: Path, tokenizer, requests: list) -> dict:
    """:func:`engine_limits.measure` on every core of the run (an epdserve worker's
    threads), with GEMMs at its default T and at the chat prompt length of ``requests``;
    prints its table."""
    prompt_t = speed_ceilings.chat_prompt_tokens(tokenizer, requests)
    tokens = tuple(sorted({*engine_limits.DEFAULT_TOKENS, prompt_t}))
    print(f"[limits] measuring the ceilings on {engine_limits.default_threads()} threads "
          f"(GEMM at T = {', '.join(map(str, tokens))})", flush=True)
    limits = engine_limits.measure(None, model_dir, tokens=tokens)
    print("\n".join(engine_limits.table(limits)), flush=True)
    return limits


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from epdserve.model.loader import ModelLoadError, resolve_model
    from epdserve.model.tokenizer import load_tokenizer

    signal.signal(signal.SIGTERM, compare._raise_interrupt)  # stop servers on kill too
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrency = sorted(set(args.concurrency))
    try:
        info = resolve_model(args.model)
        binary = llama_binary(args)
        tokenizer = load_tokenizer(info.path)
        traces = engines.level_traces(concurrency, args.num_prompts, args.input_len, args.output_len,
                                      args.seed, tokenizer)
    except (BuildError, ModelLoadError, workload.TraceError) as exc:
        print(f"speed: error: {exc}", file=sys.stderr)
        return 1

    results: dict[str, dict[int, dict]] = {}
    failures: dict[str, str] = {}
    slot = -(-(args.input_len + args.output_len + engines.TEMPLATE_MARGIN) // 256) * 256
    settings = settings_of(args, info, traces, concurrency, binary, slot)
    limits = measure_limits(info.path, tokenizer, traces[concurrency[0]])

    def record(name: str, c: int, result: dict) -> None:
        """Keep one engine's result at one level and save what exists so far, so that a
        run cut short keeps what it measured."""
        results.setdefault(name, {})[c] = result
        print(f"[{name}] C={c}: {brief(result)}", flush=True)
        write_json({"settings": settings, "limits": limits, "results": results, "failures": failures,
                    "partial": True}, out_dir / "speed.json")

    engine_runs = {
        "epdserve": lambda: settings.update(epdserve_workers=engines.run_server_engine(
            "epdserve", engines.epdserve_command(args.port, args.model, shlex.split(args.epdserve_args)), args.port,
            traces, out_dir, args.startup_timeout, record)["workers"]),
        "llama-server": lambda: engines.run_server_engine(
            "llama-server", engines.llama_server_command(binary, info.source, args.port + 1, slot),
            args.port + 1, traces, out_dir, args.startup_timeout, record),
        "transformers": lambda: run_transformers(info.path, traces, args.threads, record),
        "vllm": lambda: engines.run_vllm(args.vllm, info.path, info.name, args.port + 2,
                                         engines.vllm_env(args.vllm_bind, args.vllm_preload),
                                         traces, out_dir, args.vllm_startup_timeout, record, args.vllm_dtype),
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

    formats = {"epdserve": w["weight_format"] for w in settings.get("epdserve_workers", []) if w.get("weight_format")}
    formats["vllm"] = {"float32": "f32", "bfloat16": "bf16"}[args.vllm_dtype]
    kv_dtypes = {"epdserve": w["kv_dtype"] for w in settings.get("epdserve_workers", []) if w.get("kv_dtype")}
    kv_dtypes["vllm"] = args.vllm_dtype
    layouts = {"epdserve": ((w.get("tuned") or {}).get("q4_1_layout") or {}).get("value", "gguf")
               for w in settings.get("epdserve_workers", [])}
    found = speed_ceilings.shares(limits, results, args.output_len, info.path, info.source, formats, kv_dtypes,
                                  layouts)
    lines, agree = report_lines(args, concurrency, results, failures, limits, found)
    print("\n".join(lines))
    write_json({"settings": settings, "limits": limits, "results": results, "agreement": agree,
                "ceilings": found, "vs_vllm": {c: vs_vllm(results, c) for c in concurrency},
                "failures": failures, "table": lines}, out_dir / "speed.json")
    if results:
        plot(results, out_dir / "speed.png")
    print(f"\nwritten: {out_dir / 'speed.json'}, {out_dir / 'speed.png'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
