"""The device option (docs/gpu.md) where no GPU is needed: device names are checked where
they are read (``worker`` and ``serve`` refuse a bad one with exit 2, naming it), serve's
per-role devices reach their workers, GPU workers' KV stays out of the host-memory
estimate, ``--dtype auto`` is bfloat16 on CUDA, ``--device cpu`` is today's engine, and a
forward pass on PyTorch's ``meta`` device shows that every tensor the step makes takes the
device of its inputs. The runs on a real GPU are in ``tests/test_device_cuda.py``."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from epdserve.engine import runner
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import PromptImages, SamplingParams, Sequence
from epdserve.engine.scheduler import ScheduledBatch
from epdserve.model.device import parse_device, to_device
from epdserve.model.llama import LlamaModel
from epdserve.model.loader import auto_dtype, resolve_model
from epdserve.serving.launch import launcher
from epdserve.serving.worker import engine_worker as worker

from conftest import generate
from epdserve.serving.deployment import plan_workers
from epdserve.argtypes import config_from
from epdserve.serving.launch.options import ServeOptions

TINY = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
HAS_CUDA = torch.cuda.is_available()
WORKER = [sys.executable, "-m", "epdserve", "worker", "--role", "colocated", "--router", "ipc://x", "--bind",
          "ipc://y", "--worker-id", "w"]
SERVE = [sys.executable, "-m", "epdserve", "serve", "--host", "127.0.0.1", "--port", "0"]
GiB = 2**30


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A Llama directory (``config.json``, ``model.safetensors``) of :data:`TINY`'s shape
    with seeded N(0, 0.2²) weights and unit norms: peaked next-token distributions, so that
    greedy tokens do not hinge on float rounding."""
    c, g = TINY, torch.Generator().manual_seed(seed)
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.2

    weights = {"model.embed_tokens.weight": normal(vocab, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": normal(vocab, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
                        p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
                        p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
                        p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
                        p + "mlp.down_proj.weight": normal(h, inter)})
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY))
    return path


@pytest.fixture
def fake_gpus(monkeypatch):
    """As if this torch were a CUDA build on a host with two GPUs (for the name checks only)."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    serve, work = argparse.ArgumentParser(), argparse.ArgumentParser()
    launcher.add_arguments(serve)
    worker.add_arguments(work)
    return serve, work


# ------------------------------------------------------------------------------ names

def test_device_names_and_the_value_named_in_each_refusal():
    assert [parse_device(t) for t in ("cpu", "CPU", " cpu")] == ["cpu"] * 3
    for bad in ("gpu", "cuda:x", "cpu:0", "cuda:", "", "cuda:-1", "mps", "cuda0"):
        with pytest.raises(ValueError, match=re.escape(repr(bad)) + ": not a device"):
            parse_device(bad)


def test_cuda_names_need_a_cuda_torch_and_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=r"'cuda': no CUDA device: this torch .* is a CPU build"):
        parse_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"'cuda:0': no CUDA device: torch.cuda.is_available\(\) is False"):
        parse_device("cuda:0")


def test_cuda_names_on_a_host_with_two_gpus(fake_gpus):
    assert [parse_device(t) for t in ("cuda", "cuda:0", "CUDA:1", "cuda:01")] == ["cuda", "cuda:0", "cuda:1", "cuda:1"]
    with pytest.raises(ValueError, match=re.escape("'cuda:2': this host has 2 CUDA devices (cuda:0 .. cuda:1)")):
        parse_device("cuda:2")


def test_worker_and_serve_refuse_a_bad_device_in_one_line():
    """Exit 2 at parse time, the value named, no traceback (the worker and serve share the type)."""
    cases = [(WORKER + ["--device", "gpu"], "argument --device: 'gpu': not a device"),
             (SERVE + ["--decode-device", "cuda:x"], "argument --decode-device: 'cuda:x': not a device")]
    if not HAS_CUDA:
        cases.append((WORKER + ["--device", "cuda"], "argument --device: 'cuda': no CUDA device"))
    for argv, message in cases:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "started worker" not in proc.stderr


def test_serve_refuses_a_gpu_this_host_lacks(fake_gpus, capsys):
    serve, _ = parsers()
    for flag in ("--device", "--prefill-device", "--decode-device", "--encode-device"):
        with pytest.raises(SystemExit) as info:
            serve.parse_args([flag, "cuda:7"])
        assert info.value.code == 2
        assert f"argument {flag}: 'cuda:7': this host has 2 CUDA devices" in capsys.readouterr().err


# ------------------------------------------------------------------------ serve → workers

def test_serve_passes_each_role_its_device(fake_gpus):
    serve, work = parsers()
    args = config_from(ServeOptions, serve.parse_args(["--device", "cuda:0", "--prefill-device", "cuda:1", "--encode-device", "cpu"]))

    def device_of(role: str) -> str:
        argv = launcher.worker_command(args, role, f"{role}-0", [0], "ipc://e", "ipc://c")
        return work.parse_args(argv[4:]).device

    assert [device_of(r) for r in ("colocated", "prefill", "decode", "encode")] == ["cuda:0", "cuda:1", "cuda:0", "cpu"]
    # Nothing given: no --device passed, and the worker's own default, the CPU, holds.
    argv = launcher.worker_command(config_from(ServeOptions, serve.parse_args([])), "decode", "d-0", [0], "e", "c")
    assert "--device" not in argv and work.parse_args(argv[4:]).device == "cpu"


def test_capacity_leaves_a_gpu_workers_kv_out_of_host_memory(tmp_path, fake_gpus):
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(512 * 2**20)  # 0.5 GiB of weights (a sparse file)
    serve, _ = parsers()
    plan = plan_workers("pd", [0, 1], prefill=1, decode=1)
    # Both on the CPU: 2 x (0.5 + 1) GiB.
    args = config_from(ServeOptions, serve.parse_args(["--mode", "pd", "--kv-cache-memory-mb", "1024"]))
    assert "need about 3.0 GiB" in launcher.check_capacity(args, plan, tmp_path, 2 * GiB)[1]
    # The decode worker's KV cache on its GPU: its weights only pass through host memory.
    args = config_from(ServeOptions, serve.parse_args(["--mode", "pd", "--kv-cache-memory-mb", "1024",
                                                      "--decode-device", "cuda:1"]))
    assert launcher.check_capacity(args, plan, tmp_path, 2 * GiB) == ([], None)
    error = launcher.check_capacity(args, plan, tmp_path, int(1.9 * GiB))[1]
    assert "need about 2.0 GiB" in error and "GPU workers: no KV cache in host memory" in error


def test_dtype_auto_is_bfloat16_on_cuda(tmp_path):
    (tmp_path / "quantized").mkdir()
    (tmp_path / "quantized" / "blocks.safetensors").write_bytes(b"x")  # a quantized GGUF's conversion
    assert auto_dtype(tmp_path, True, "cpu") == "float32"  # its CPU kernels compute in float32
    assert auto_dtype(tmp_path, True, "cuda") == auto_dtype(tmp_path, True, "cuda:1") == "bfloat16"


# ------------------------------------------------------------------------------ engine

def test_explicit_cpu_is_todays_engine():
    """The default model, kernels and GGUF blocks included: ``device="cpu"`` is the default's
    engine, token for token, and its step's metadata is not copied."""
    path = str(resolve_model().path)
    prompts = [[1, 2, 3], list(range(100, 140))]
    default = LLMEngine(path, EngineConfig(kv_cache_memory_mb=16))
    cpu = LLMEngine(path, EngineConfig(kv_cache_memory_mb=16, device="cpu"))
    assert cpu.device == torch.device("cpu") and cpu.kv_cache.device.type == "cpu"
    assert generate(cpu, prompts, GREEDY) == generate(default, prompts, GREEDY)
    ids, positions = torch.arange(3), torch.arange(3)
    assert all(a is b for a, b in zip(to_device([ids, positions], torch.device("cpu")), [ids, positions]))


def test_engine_refuses_devices_it_cannot_use(tmp_path):
    path = str(write_tiny_llama(tmp_path / "m"))
    with pytest.raises(ValueError, match="'gpu': not a device"):
        LLMEngine(path, EngineConfig(device="gpu"))
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="'cuda:0': no CUDA device"):
            LLMEngine(path, EngineConfig(device="cuda:0"))
    model = LlamaModel.load(path, device="meta")
    with pytest.raises(ValueError, match=r"allocator gave .* on cpu, not .* on meta"):
        model.allocate_kv_cache(4, 16, allocator=lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    with pytest.raises(ValueError, match="run on the CPU only"):
        LlamaModel(model.config, {}, torch.float32, blocks={"x": None}, device="meta")


def test_to_device_moves_index_tensors_in_one_buffer():
    tensors = [torch.arange(5), torch.zeros(2, 3, dtype=torch.long), torch.zeros(0, 0, dtype=torch.long)]
    moved = to_device(tensors, torch.device("meta"))
    assert [(t.device.type, tuple(t.shape)) for t in moved] == [("meta", (5,)), ("meta", (2, 3)), ("meta", (0, 0))]
    assert all(t._base is moved[0]._base is not None for t in moved)  # views of one buffer
    with pytest.raises(ValueError, match="int64"):
        to_device([torch.zeros(2)], torch.device("meta"))


def _mixed_batch(vocab: int, hidden: int) -> ScheduledBatch:
    """One step of every kind the forward pass knows: a fresh prefill with image
    embeddings (token 5 is the image token), a chunk behind fewer cached tokens than it
    has (the zero-query path), one behind more (the explicit mask), and two decodes;
    blocks of 16, disjoint."""
    def seq(rid: str, n: int, computed: int, blocks: list[int], first: int | None = None) -> Sequence:
        s = Sequence(rid, [10 + (7 * k) % (vocab - 10) for k in range(n)], GREEDY, first_token=first)  # no 5
        s.num_computed_tokens, s.block_table = computed, blocks
        return s

    fresh = seq("fresh", 20, 0, [0, 1])
    fresh.token_ids[3:7] = [5] * 4
    fresh.images = PromptImages(fresh.token_ids[:20], 5, [("h", 4)], torch.randn(4, hidden), hidden)
    few = seq("few", 40, 8, [2, 3, 4])
    many = seq("many", 40, 30, [5, 6, 7])
    decodes = [seq(f"d{i}", 17 + i, 17 + i, [8 + 2 * i, 9 + 2 * i], first=3) for i in range(2)]
    batch = [fresh, few, many, *decodes]
    return ScheduledBatch(batch, [20, 32, 10, 1, 1])


def test_forward_pass_on_the_meta_device(tmp_path):
    """The same step on the CPU and on ``meta`` (shapes, no data): an operand left on the
    host (an ``arange`` or mask without its inputs' device) fails the meta run."""
    path = write_tiny_llama(tmp_path / "m")
    batch = _mixed_batch(TINY["vocab_size"], TINY["hidden_size"])
    shapes = []
    for device in ("cpu", "meta"):
        model = LlamaModel.load(path, device=device)
        assert {t.device.type for t in (model.embed, model.cos, model.norm, model.layers[0]["qkv"].dense)} == {device}
        logits, sampled = runner.run(model, batch, model.allocate_kv_cache(16, 16))
        assert logits.device.type == device
        shapes.append((tuple(logits.shape), sampled))
    assert shapes[0] == shapes[1] == ((5, TINY["vocab_size"]), [0, 1, 2, 3, 4])
