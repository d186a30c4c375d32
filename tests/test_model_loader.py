"""Model loading: Hugging Face directories of each supported type against transformers,
and clear errors for missing, corrupt or unsupported models."""

from __future__ import annotations

import json

import pytest
import torch

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.loader import ModelLoadError, resolve_model

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2)


def tiny_model(kind: str):
    """A tiny randomly initialised transformers model of ``kind`` (seeded)."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        config = tf.LlamaConfig(**TINY, tie_word_embeddings=False)
    elif kind == "llama-rope-llama3":
        config = tf.LlamaConfig(**TINY, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=500000.0)
    elif kind == "llama-rope-linear":
        config = tf.LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    elif kind == "mistral":
        config = tf.MistralConfig(**TINY, sliding_window=None)
    else:
        config = tf.Qwen2Config(**TINY, tie_word_embeddings=True)
    return tf.AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("kind", ["llama", "llama-rope-llama3", "llama-rope-linear", "mistral", "qwen2"])
def test_hf_directory_greedy_matches_transformers(tmp_path, kind):
    hf = tiny_model(kind)
    hf.save_pretrained(tmp_path)
    info = resolve_model(tmp_path)
    assert info.path == tmp_path and info.max_model_len == 512
    engine = LLMEngine(str(info.path), EngineConfig(block_size=16, kv_cache_memory_mb=4))
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate([3, 16, 40, 150])]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=20, min_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(p):].tolist()
            assert got[str(i)] == ref, f"{kind} prompt {i}"


def test_missing_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model.gguf: no such file"):
        resolve_model(tmp_path / "no-such-model.gguf")


def test_corrupt_gguf_names_file_and_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("EPDSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        resolve_model(bad)
    assert not any((tmp_path / "cache").glob("*")), "a failed conversion must leave no cache entry"


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture model_type='gpt2'"):
        resolve_model(tmp_path)


def test_directory_without_weights_or_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(tmp_path)


def test_corrupt_safetensors_names_the_file(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read"):
        LLMEngine(str(resolve_model(tmp_path).path), EngineConfig(kv_cache_memory_mb=1))
