"""The workload and the server engines of ``benchmarks/speed.py``: the per-level prompts,
the bench client's options, and starting, driving and stopping ``epdserve serve``,
llama.cpp's ``llama-server`` and ``vllm serve`` (each in its own process group, its log
under the output folder)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from epdserve.bench import datasets, workload
from epdserve.bench.processes import SERVE, ServerError, ServerProcess, port_is_free, wait_ready
from epdserve.bench.run import ClientOptions, bench
from llama_build import runtime_flags  # benchmarks/

ALL_AT_ONCE = workload.ArrivalOptions(request_rate=float("inf"))
LLAMA_PARALLEL = 32  # llama-server slots: as many as the highest default concurrency
LLAMA_THREADS = 2
# Chat-template tokens around a user message (SmolLM2's template with its default system
# prompt is ~30); a llama-server slot must hold them as well as the prompt and output.
TEMPLATE_MARGIN = 64

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_STAMP = VLLM_VENV / ".installed"  # written by `make vllm` once the venv is complete
VLLM_MAX_MODEL_LEN = 4096
VLLM_KV_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: its default (0.92 of the NUMA node's memory) fails here
VLLM_STARTUP_TIMEOUT_S = 600.0  # ~2 minutes here, with a normal 60 s shm-broadcast pause


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


def client_args(concurrency: int, timeout_s: float) -> ClientOptions:
    """The options :func:`epdserve.bench.run.bench` reads, as ``epdserve bench`` would set
    them: chat endpoint, greedy, ignore_eos, one warm-up request, closed loop of C, a
    progress bar."""
    return ClientOptions(endpoint="chat", temperature=0.0, ignore_eos=True, disable_tqdm=False,
                         request_timeout=timeout_s, warmup=1, warmup_requests=0,
                         max_concurrency=concurrency, goodput=None)


# ---------------------------------------------------------------------------------------
# Engines behind an OpenAI endpoint


def run_server_engine(name: str, cmd: list[str], port: int, traces: dict, out_dir: Path,
                      startup_timeout_s: float, record, env: dict[str, str] | None = None,
                      health_workers: int = 1) -> dict:
    """Start ``cmd`` (its own process group, environment plus ``env``, log
    ``out_dir/NAME.log``), wait for ``/health`` 200 (with ``health_workers`` workers up
    when the body lists workers, as epdserve's does; 0: any 200, for a server whose body is
    empty), run every level's trace with the bench client, passing each result to
    ``record(NAME, C, bench result)``, stop its whole process group (also on errors and
    Ctrl-C). Returns what its ``/health`` said of its workers (``ServerProcess.resources``:
    epdserve's cores and weight formats; none for other servers).

    Raises:
        ServerError: the port is taken, or the server exited or did not come up in time
            (the message names its log).
        client.ClientError: it stopped answering or the warm-up failed.
    """
    if not port_is_free(port):
        raise ServerError(f"{name}: port {port} on 127.0.0.1 is in use; pass --port")
    log = out_dir / f"{name}.log"
    server = ServerProcess(name, cmd, log, f"http://127.0.0.1:{port}", env=env)
    shown_env = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    print(f"[{name}] starting: {shown_env + ' ' if shown_env else ''}{' '.join(cmd)}", flush=True)
    try:
        server.start()
        try:
            took = wait_ready(server.base_url + "/health", [server], startup_timeout_s,
                              workers=health_workers)
        except ServerError as exc:
            reason = exc.reason if exc.reason.startswith(name) else f"{name}: {exc.reason}"
            raise ServerError(f"{reason} (log: {log})", exc.log_tail) from None
        print(f"[{name}] healthy after {took:.1f} s", flush=True)
        resources = server.resources()
        for c, requests in traces.items():
            record(name, c, bench(server.base_url, requests, client_args(c, 600.0), arrivals=ALL_AT_ONCE))
        return resources
    finally:
        server.stop()


def epdserve_command(port: int, model: str | None, extra: list[str] = ()) -> list[str]:
    """``epdserve serve`` colocated with one worker on every core, plus ``extra`` flags."""
    cmd = [*SERVE, "--mode", "colocated", "--workers", "1", "--host", "127.0.0.1",
           "--port", str(port)]
    return cmd + (["--model", model] if model else []) + list(extra)


def llama_server_command(binary: Path, gguf: str, port: int, slot_tokens: int) -> list[str]:
    """``llama-server`` on ``gguf`` with :data:`LLAMA_PARALLEL` slots of ``slot_tokens``
    each (the context is split evenly among slots when ``--parallel`` is given)."""
    return [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--alias", Path(gguf).name.split(".")[0],
            "--parallel", str(LLAMA_PARALLEL), "--threads", str(LLAMA_THREADS),
            "--threads-batch", str(LLAMA_THREADS), "--ctx-size", str(LLAMA_PARALLEL * slot_tokens),
            "--cont-batching", "--jinja", "--no-webui", *runtime_flags()]


def vllm_installed() -> bool:
    """Whether ``make vllm`` finished (its stamp file exists)."""
    return VLLM_STAMP.is_file()


def cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the CPU list form of VLLM_CPU_OMP_THREADS_BIND)."""
    parts, cores = [], sorted(cores)
    start = prev = cores[0]
    for c in cores[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(parts)


def default_vllm_bind() -> str:
    """Every core of this run (``os.sched_getaffinity``), e.g. ``0-1``: vLLM's OpenMP
    threads on the cores epdserve's worker gets."""
    return cpu_list(sorted(os.sched_getaffinity(0)))


def vllm_bind(text: str) -> str:
    """``--vllm-bind``: ``auto`` (vLLM's default: a core is left to its front end) or a CPU
    list such as ``0-1`` or ``0,2-3``."""
    if text != "auto" and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text):
        raise ValueError(f"--vllm-bind {text!r}: expected auto or a CPU list such as 0-1")
    return text


def vllm_command(binary: Path, model_dir: Path, served_name: str, port: int, dtype: str = "float32") -> list[str]:
    """``vllm serve`` on the float32 Hugging Face directory epdserve serves, in ``dtype``."""
    return [str(binary), "serve", str(model_dir), "--dtype", dtype,
            "--max-model-len", str(VLLM_MAX_MODEL_LEN), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_env(bind: str, preload: list[str] = (), kv_gib: int = VLLM_KV_GIB) -> dict[str, str]:
    """vLLM's CPU settings: the KV cache space (GiB), the OpenMP binding and the libraries
    its log asks to have preloaded (tcmalloc, Intel's OpenMP; docs/vllm.md)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": bind}
    return {**env, "LD_PRELOAD": ":".join(preload)} if preload else env


def run_vllm(binary: Path, model_dir: Path, served_name: str, port: int, env: dict[str, str], traces: dict,
             out_dir: Path, startup_timeout_s: float, record, dtype: str = "float32") -> None:
    """:func:`run_server_engine` for ``vllm serve`` with ``env`` (:func:`vllm_env`; its
    ``/health`` answers 200 with an empty body once the engine is up).

    Raises:
        ServerError: no vllm binary (run ``make vllm``), or as :func:`run_server_engine`.
    """
    if not os.access(binary, os.X_OK):
        raise ServerError(f"vllm: {binary} is not an executable file; run `make vllm` "
                          f"(or pass --vllm PATH)")
    run_server_engine("vllm", vllm_command(binary, model_dir, served_name, port, dtype), port, traces,
                      out_dir, startup_timeout_s, record, env=env, health_workers=0)
