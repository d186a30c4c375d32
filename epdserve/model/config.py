"""The decoder's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from epdserve.model.base import SUPPORTED_MODEL_TYPES, ModelLoadError


@dataclass(frozen=True)
class ModelConfig:
    """Hugging Face field names; ``rope_scaling``: None or ``rope_type`` "linear"/"llama3" (transformers'
    ``modeling_rope_utils``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    rope_scaling: dict | None = field(default=None)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """The decoder's, or a VLM's ``text_config``. Raises ModelLoadError: unsupported model or RoPE type."""
        path = Path(model_dir) / "config.json"
        cfg = json.loads(path.read_text())
        return cls.from_dict(cfg.get("text_config", cfg), str(path))

    @classmethod
    def from_dict(cls, cfg: dict, path: str = "config") -> "ModelConfig":
        """``path`` names the source in errors. Raises ModelLoadError as :meth:`from_dir`."""
        if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"{path}: unsupported architecture {cfg.get('model_type')!r}")
        # transformers 5 writes "rope_parameters" (theta included); 4.x "rope_scaling".
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("linear", "llama3", "default"):
            raise ModelLoadError(f"{path}: unsupported RoPE scaling type {kind!r}"
                                 " (supported: linear, llama3)")
        scaling = None if kind == "default" else {**rope, "rope_type": kind}
        eos = cfg.get("eos_token_id", [])
        heads = cfg["num_attention_heads"]
        return cls(
            model_type=cfg["model_type"],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]),
            rope_scaling=scaling,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes per token: layers × 2 (K and V) × KV heads × head dim × bytes."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes
