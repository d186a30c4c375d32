"""The same prefill split for vLLM's CPU build, from its torch profiler: ``prefill_profile.py
--vllm`` starts ``vllm serve`` (as speed.py does, ``.venv-vllm``) with
``--profiler-config.profiler torch``, sends the prompts one at a time (``max_tokens`` 1,
so each request is one prefill and its first token), between ``/start_profile`` and
``/stop_profile``, and reads the trace it writes: each CPU operator's self time (its time
less that of the operators it called, per thread), summed per part by name and divided by
the requests.

Parts, by operator name (vLLM's CPU operators as its 0.32 build names them; whatever matches
none is "other"): GEMMs (``onednn_mm``, packed linear, ``aten::mm``/``addmm``/``linear``), the
KV write, attention, RMSNorm, RoPE, SiLU x up, sampling, and the compiled graph's own time
(Inductor's fused C++ kernels: the small operators vLLM's ``torch.compile`` fused, which do
not show as operators of their own). The profiler's own
overhead lengthens each operator by about a microsecond.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import httpx

import speed_engines
from epdserve.bench.processes import ServerProcess, port_is_free, wait_ready

PATTERNS = (  # (part, operator name pattern), the first that matches wins
    ("GEMMs", r"onednn_mm|weight_packed_linear|aten::(mm|addmm|linear)$|mkl_linear|_linear_pointwise"),
    ("KV write", r"kv_cache_update|reshape_and_cache"),
    ("attention", r"attention|attn|sdpa|paged"),
    ("RMSNorm", r"rms_norm"),
    ("RoPE", r"rotary"),
    ("SiLU x up", r"silu|act_and_mul"),
    ("sampling", r"sampl|argmax|top_?k|top_?p|gumbel"),
    ("compiled graph (fused small operators)", r"CompiledFxGraph|cpp_fused|inductor|Torch-Compiled|CompiledFunction"),
)


def part_of(name: str) -> str:
    """The part an operator named ``name`` counts in (see :data:`PATTERNS`)."""
    return next((part for part, pattern in PATTERNS if re.search(pattern, name)), "other")


def self_times(events: list[dict]) -> dict[str, float]:
    """Self time (µs) per name of a chrome trace's complete events of CPU operators and
    annotated ranges: each event's duration less that of the events directly nested in it
    on its thread (a range's self time is what ran between its operators)."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                out[stack[-1]["name"]] -= e["dur"]
            out[e["name"]] += e["dur"]
            stack.append(e)
    return out


def split(trace_dir: Path, requests: int) -> dict:
    """``{"parts": {part: ms per request}, "top": [(operator, part, ms per request)]}`` from
    every trace file under ``trace_dir``."""
    totals: dict[str, float] = defaultdict(float)
    files = sorted(trace_dir.rglob("*.json*"))
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            data = json.load(fh)
        for name, us in self_times(data.get("traceEvents", [])).items():
            totals[name] += us
    parts: dict[str, float] = defaultdict(float)
    for name, us in totals.items():
        parts[part_of(name)] += us / 1e3 / requests
    top = sorted(((n, part_of(n), us / 1e3 / requests) for n, us in totals.items()), key=lambda t: -t[2])[:12]
    return {"parts": dict(parts), "top": top, "trace_files": [str(f) for f in files]}


def run(prompts: list[str], model_dir: Path, served_name: str, port: int, out_dir: Path, bind: str,
        startup_timeout_s: float = speed_engines.VLLM_STARTUP_TIMEOUT_S, dtype: str = "float32") -> dict:
    """Start vLLM (``--dtype dtype``) with its torch profiler, send ``prompts`` (chat messages' text) one at a time
    with ``max_tokens`` 1 while profiling, stop it: :func:`split` of its trace, with the
    requests' mean wall time (ms)."""
    binary = speed_engines.VLLM_VENV / "bin" / "vllm"
    if not port_is_free(port):
        raise RuntimeError(f"vllm: port {port} on 127.0.0.1 is in use; pass --port")
    trace_dir = (out_dir / "vllm-trace").resolve()
    shutil.rmtree(trace_dir, ignore_errors=True)  # (split reads every trace in it: an earlier run's too)
    cmd = speed_engines.vllm_command(binary, model_dir, served_name, port, dtype) + [
        "--profiler-config.profiler", "torch", "--profiler-config.torch_profiler_dir", str(trace_dir)]
    server = ServerProcess("vllm", cmd, out_dir / "vllm-profile.log", f"http://127.0.0.1:{port}",
                           env=speed_engines.vllm_env(bind))
    print(f"[vllm] starting with its profiler: {' '.join(cmd)}", flush=True)
    server.start()
    try:
        wait_ready(server.base_url + "/health", [server], startup_timeout_s)
        walls = []
        with httpx.Client(base_url=server.base_url, timeout=600, trust_env=False) as http:
            def ask(text: str) -> None:
                http.post("/v1/chat/completions", json={"model": served_name, "max_tokens": 1, "temperature": 0,
                                                        "messages": [{"role": "user", "content": text}]}
                          ).raise_for_status()
            ask("warm up")
            http.post("/start_profile").raise_for_status()
            for text in prompts:
                t0 = time.perf_counter()
                ask(text)
                walls.append((time.perf_counter() - t0) * 1e3)
            http.post("/stop_profile", timeout=600).raise_for_status()
        deadline = time.monotonic() + 120  # the trace is written after stop_profile answers
        while not list(trace_dir.rglob("*.json*")) and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(2)
    finally:
        server.stop()
    return {**split(trace_dir, len(prompts)), "request_ms_mean": sum(walls) / len(walls)}
