"""A model's size as the cost model needs it: parameters, FLOPs and KV bytes per token, and a
vision-language model's tower FLOPs per tile and image preprocessing."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from epdserve.model.config import ModelConfig
from epdserve.model.image_processor import ImageProcessor
from epdserve.model.vision import VisionConfig


@dataclass(frozen=True)
class ModelSpec:
    """Decoder shape in Hugging Face's field meanings; ``mlp_matrices`` 3 for a gated MLP, 2 for
    a plain one (OPT); ``vision``/``processor`` None for a text-only model."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    mlp_matrices: int = 3
    vision: VisionConfig | None = None
    processor: ImageProcessor | None = None

    @classmethod
    def from_config(cls, name: str, c: ModelConfig) -> "ModelSpec":
        return cls(name, c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                   c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size)

    @classmethod
    def from_dir(cls, name: str, model_dir: str | Path, multimodal: bool) -> "ModelSpec":
        """Llama-family, or (``multimodal``) Idefics3 / SmolVLM. Raises ModelLoadError."""
        if not multimodal:
            return cls.from_config(name, ModelConfig.from_dir(model_dir))
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        vision = VisionConfig.from_dict(cfg)
        text = cls.from_config(name, ModelConfig.from_dict(cfg["text_config"], f"{model_dir}/config.json"))
        return replace(text, vision=vision,
                       processor=ImageProcessor.from_dir(model_dir, vision.tokens_per_image))

    @property
    def layer_params(self) -> int:
        """Decoder layers' weights, embeddings left out."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        return self.num_layers * (attention + self.mlp_matrices * h * self.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Embedding and LM head counted apart (a few % over for tied ones), vision tower
        included."""
        return (self.layer_params + 2 * self.lm_head_params + self.vision_params) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, new_tokens: int, context: int) -> float:
        """Causal QK^T and PV: 4 × layers × heads × head_dim × keys seen (2 matmuls × 2
        FLOPs/MAC)."""
        keys = new_tokens * context + new_tokens * (new_tokens + 1) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * keys

    @property
    def vision_params(self) -> int:
        """Tower (patch embedding, layers) and connector projection; 0 for text-only."""
        v = self.vision
        if v is None:
            return 0
        d = v.hidden_size
        patch = v.num_channels * v.patch_size ** 2 * d
        layer = 4 * d * d + 2 * d * v.intermediate_size  # q, k, v, out; fc1, fc2
        return patch + v.num_hidden_layers * layer + d * v.scale_factor ** 2 * v.text_hidden_size

    def vision_flops_per_tile(self) -> float:
        """2 FLOPs per MAC over the tile's patches, bidirectional attention (4 ×
        layers × patches² × hidden), and the pixel-shuffled projection."""
        v = self.vision
        patches = v.patches_per_side ** 2
        linear = self.vision_params - v.hidden_size * v.scale_factor ** 2 * v.text_hidden_size
        projection = v.tokens_per_image * v.hidden_size * v.scale_factor ** 2 * v.text_hidden_size
        attention = 4.0 * v.num_hidden_layers * patches ** 2 * v.hidden_size
        return 2.0 * patches * linear + attention + 2.0 * projection


# SmolVLM-256M-Instruct: SigLIP base patch16/512, pixel shuffle 4 -> 64 tokens per 512-px tile,
# 2048-px longest edge (up to 4 x 4 tiles + the global image).
_SIGLIP_B16_512 = VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                               num_attention_heads=12, image_size=512, patch_size=16, layer_norm_eps=1e-6,
                               scale_factor=4, text_hidden_size=576)
# Idefics3-8B-Llama3: SigLIP so400m patch14/364, pixel shuffle 2 -> 169 tokens per tile.
_SIGLIP_SO400M_364 = VisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                  num_attention_heads=16, image_size=364, patch_size=14, layer_norm_eps=1e-6,
                                  scale_factor=2, text_hidden_size=4096)

# Published architectures (each its config.json) to check the planner against published results.
BUILTIN: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("OPT-13B", 40, 5120, 20480, 40, 40, 128, 50272, mlp_matrices=2),
    ModelSpec("Qwen3-32B", 64, 5120, 25600, 64, 8, 128, 151936),
    ModelSpec("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256),
    # Mooncake's experiments use its architecture.
    ModelSpec("Llama-2-70B", 80, 8192, 28672, 64, 8, 128, 32000),
    # Also the shape of DeepSeek-R1-Distill-Llama-70B.
    ModelSpec("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256),
    # BLOOM: no GQA, a plain 4 x hidden GELU MLP.
    ModelSpec("BLOOM-176B", 70, 14336, 4 * 14336, 112, 112, 128, 250880, mlp_matrices=2),
    ModelSpec("SmolVLM-256M", 30, 576, 1536, 9, 3, 64, 49280, vision=_SIGLIP_B16_512,
              processor=ImageProcessor(longest_edge=2048, max_image_size=512, image_seq_len=64)),
    ModelSpec("Idefics3-8B", 32, 4096, 14336, 32, 8, 128, 128259, vision=_SIGLIP_SO400M_364,
              processor=ImageProcessor(longest_edge=4 * 364, max_image_size=364, image_seq_len=169)),
)}
