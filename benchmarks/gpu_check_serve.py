"""The served parts of ``benchmarks/gpu_check.py``: seeded random Llama directories in the
layout our loader reads (``config.json``, ``*.safetensors`` with Hugging Face names, and a
word-level tokenizer so that the router starts), real ``epdserve serve`` deployments (the
router and its worker processes), a streaming client that stamps every chunk, and the
parity checks' small transformers Llama and prompts (``parity`` and ``tensor_parallel``).

Nothing is downloaded: the weights are ``N(0, std²)`` from a seed (norms 1), the tokenizer
is ``w0 .. w{V-1}`` built with the ``tokenizers`` library, and prompts are sent as token ids.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

READY = re.compile(r"epdserve serve: ready at (http://\S+)")

# Llama-3.1-8B's shape: 32 layers, hidden 4096, 32 query / 8 KV heads of 128,
# intermediate 14,336, vocabulary 128,256; context cut to 16,384 (8k prompts fit one step).
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=16384, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
# The smoke stand-in for it (CPU, seconds).
TINY = dict(LLAMA_8B, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)


def layer_shapes(config: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes of decoder layer ``layer`` of ``config``."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv, p = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, f"model.layers.{layer}."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)}


def write_llama_dir(path: Path, config: dict, device: str, seed: int = 0, std: float = 0.02,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """A model directory at ``path``: ``config.json``, one safetensors file per layer (plus
    one for embeddings, final norm and LM head) of seeded ``N(0, std²)`` weights in
    ``dtype`` (norms 1), made on ``device`` (fast for 16 GB) and written from the host, and a
    tokenizer of ``config["vocab_size"]`` words. Returns ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device=device).manual_seed(seed)

    def tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in shapes.items():
            if len(shape) == 1:
                out[name] = torch.ones(shape, dtype=dtype)
            else:
                out[name] = (torch.randn(shape, generator=generator, device=device) * std).to(dtype).cpu()
        return out

    h, v = config["hidden_size"], config["vocab_size"]
    save_file(tensors({"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}),
              str(path / "model-head.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        save_file(tensors(layer_shapes(config, layer)), str(path / f"model-layer{layer:03d}.safetensors"))
    (path / "config.json").write_text(json.dumps(dict(config, torch_dtype=str(dtype).removeprefix("torch."))))
    write_tokenizer(path, v)
    return path


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` words ``w0 ..`` (``w0`` unknown, ``w1`` BOS,
    ``w2`` EOS; a chat template joining the messages) saved as a Hugging Face fast
    tokenizer in ``path`` (what the router loads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # the router checks it has one
    fast.save_pretrained(str(path))


def seeded_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids in ``[3, vocab)`` from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def parity_llama(path: Path):
    """The parity checks' small Llama (3 layers, hidden 128, 4 query / 2 KV heads, vocabulary
    512), built as transformers' ``LlamaForCausalLM`` with seeded N(0, 0.2²) weights (norms
    1: peaked logits, greedy tokens not on a rounding edge) and saved as safetensors at
    ``path``. Returns the float32 model (on the CPU, eval mode)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn(param.shape, generator=g) * 0.2)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def parity_prompts() -> list[list[int]]:
    """The parity checks' 4 prompts (5, 17, 33 and 64 tokens; prefixes of one seeded prompt)."""
    prompt = seeded_prompts(1, 64, 512, seed=1)[0]
    return [prompt[:n] for n in (5, 17, 33, 64)]


class Deployment:
    """``epdserve serve --mode MODE`` on this host, its router's URL and trace file. A
    context manager: stopped (SIGTERM, then SIGKILL of its process group) on exit.

    Raises (on entry): RuntimeError naming the log's tail if it exits or is not ready
    within ``timeout_s``."""

    def __init__(self, mode: str, model_dir: Path, workdir: Path, device: str, extra: list[str],
                 timeout_s: float = 300.0):
        self.mode, self.timeout_s = mode, timeout_s
        self.log_path, self.trace_path = workdir / f"serve-{mode}.log", workdir / f"trace-{mode}.jsonl"
        self.argv = [sys.executable, "-m", "epdserve", "serve", "--mode", mode, "--model", str(model_dir),
                     "--served-model-name", "m", "--host", "127.0.0.1", "--port", "0", "--device", device,
                     "--trace-file", str(self.trace_path), *extra]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> Deployment:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self.url:
                match = READY.search(self.log_tail(10**9))
                if match:
                    self.url = match.group(1)
                elif self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve --mode {self.mode} did not start (exit {self.proc.poll()}):\n"
                                       f"{self.log_tail()}")
                time.sleep(0.3)
            return self
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def traces(self) -> dict[str, dict]:
        """The trace records written so far, by request id."""
        if not self.trace_path.exists():
            return {}
        return {r["request_id"]: r for r in map(json.loads, self.trace_path.read_text().splitlines())}

    def trace(self, request_id: str, timeout_s: float = 30.0) -> dict:
        """The trace record of ``request_id`` (waits for it). Raises RuntimeError if none."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rec = self.traces().get(request_id)
            if rec is not None:
                return rec
            time.sleep(0.05)
        raise RuntimeError(f"no trace record of {request_id} in {self.trace_path}")


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                     delay_s: float = 0.0) -> dict:
    """One streamed ``/v1/completions`` request (token ids, greedy, ``ignore_eos``) sent
    after ``delay_s``; returns ``id``, ``ttft_ms`` (send to first chunk) and ``itl_ms`` (the
    gaps between later chunks, each a token), or ``error``."""
    await asyncio.sleep(delay_s)
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, stamps, rid = time.perf_counter(), [], None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                rid = rid or chunk.get("id")
                if any(c.get("text") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if not stamps:
        return {"error": "no tokens streamed", "id": rid}
    return {"id": rid, "ttft_ms": (stamps[0] - start) * 1e3,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:])]}


async def run_trace(url: str, requests: list[tuple[float, list[int], int, str]], timeout_s: float) -> list[dict]:
    """Send ``(delay_s, prompt, max_tokens, kind)`` requests concurrently; returns each one's
    :func:`stream_one` result with its ``kind``."""
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        results = await asyncio.gather(*(stream_one(client, url, p, n, d) for d, p, n, _ in requests))
    return [dict(r, kind=kind) for r, (_, _, _, kind) in zip(results, requests)]


def percentiles(values: list[float]) -> dict:
    """p50 / p95 / p99 (nearest rank) and the count of ``values`` (ms); None when empty."""
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"n": len(ordered), "p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99),
            "mean": statistics.fmean(ordered)}


def latency_summary(results: list[dict]) -> dict:
    """TTFT and ITL percentiles (ms) of ``results`` overall and by kind, and the errors."""
    out = {"errors": [r["error"] for r in results if "error" in r]}
    for kind in ["all", *sorted({r["kind"] for r in results})]:
        rows = [r for r in results if "error" not in r and kind in ("all", r["kind"])]
        out[kind] = {"ttft_ms": percentiles([r["ttft_ms"] for r in rows]),
                     "itl_ms": percentiles([gap for r in rows for gap in r["itl_ms"]])}
    return out
