"""SmolVLM / Idefics3 directories → vision encoder + Llama language model, and the default multimodal model:
SmolLM2-135M-Instruct plus a SmolVLM-256M-shaped vision tower with SEEDED SYNTHETIC weights (``synthetic_vision``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from epdserve.model import linear, tensor_parallel
from epdserve.model.base import ModelLoadError, cache_root, cached_dir
from epdserve.model.config import ModelConfig
from epdserve.model.gguf_convert import default_text_dir
from epdserve.model.image_processor import IMAGE_TOKEN, SPECIAL_TOKENS, ImageProcessor
from epdserve.model.llama import LlamaModel
from epdserve.model.vision import (CONNECTOR_WEIGHT, VISION_PREFIX, VisionConfig, VisionEncoder, is_vision_weight,
                                   read_config, read_weights)

TEXT_PREFIX = "model.text_model."

# SmolVLM-256M-Instruct's vision tower (google/siglip-base-patch16-512) and connector, from
# its published config.json: scale_factor 4, so a 512-pixel tile gives 32² / 4² = 64 tokens.
SMOLVLM_256M_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                           num_attention_heads=12, image_size=512, patch_size=16, layer_norm_eps=1e-6,
                           num_channels=3, hidden_act="gelu_pytorch_tanh", model_type="idefics3_vision")
SMOLVLM_256M_SCALE_FACTOR = 4
# SmolVLM-256M resizes to 2048 px (up to 17 tiles); one 512 px tile keeps CPU encoding affordable.
DEFAULT_LONGEST_EDGE = 512
DEFAULT_SEED = 0


@dataclass
class SmolVLM:
    """``synthetic_vision``: random vision weights, image outputs mean nothing."""

    path: Path
    vision: VisionEncoder
    text: LlamaModel
    processor: ImageProcessor
    image_token_id: int
    synthetic_vision: bool

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> "SmolVLM":
        """Both towers on ``device``. Raises ModelLoadError: wrong model type, unreadable or missing weights."""
        cfg = read_config(model_dir)
        vision_config = VisionConfig.from_dict(cfg)
        weights = read_weights(model_dir)
        try:
            vision = VisionEncoder(vision_config, weights, dtype, device)
        except KeyError as exc:
            raise ModelLoadError(f"{model_dir}: missing tensor {exc}") from None
        return cls(path=Path(model_dir), vision=vision, text=_text_model(model_dir, cfg, weights, dtype, device),
                   processor=ImageProcessor.from_dir(model_dir, vision_config.tokens_per_image),
                   image_token_id=cfg["image_token_id"], synthetic_vision=bool(cfg.get("synthetic_vision")))

    def image_embeds(self, input_ids: torch.Tensor, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Idefics3's ``inputs_merger``: ``(rows [R], values [R, hidden])``. Raises ValueError if the counts differ."""
        rows = (input_ids == self.image_token_id).nonzero().flatten()
        values = embeddings.reshape(-1, embeddings.shape[-1])
        if len(rows) != len(values):
            raise ValueError(f"{len(rows)} {IMAGE_TOKEN} tokens for {len(values)} image embeddings")
        return rows, values


def load_text(model_dir: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", weight_format: str = "auto",
              tp: tensor_parallel.TPRank | None = None) -> tuple[LlamaModel, int]:
    """The language model alone (vision tower unread), dense, and ``image_token_id``. Raises as ``LlamaModel``."""
    fmt = linear.resolve(weight_format, dtype, has_blocks=False)
    cfg = read_config(model_dir)
    weights = read_weights(model_dir, keep=lambda name: not is_vision_weight(name))
    return _text_model(model_dir, cfg, weights, dtype, device, fmt, tp), cfg["image_token_id"]


def _text_model(model_dir: str | Path, cfg: dict, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device = "cpu", fmt: linear.WeightFormat | None = None,
                tp: tensor_parallel.TPRank | None = None) -> LlamaModel:
    text_weights = {("model." + k[len(TEXT_PREFIX):] if k.startswith(TEXT_PREFIX) else k): v.to(dtype)
                    for k, v in weights.items() if not is_vision_weight(k)}
    # Tied exactly when the checkpoint has no lm_head (transformers does not save tied copies).
    text_config = dataclasses.replace(ModelConfig.from_dict(cfg["text_config"], f"{model_dir}/config.json"),
                                      tie_word_embeddings="lm_head.weight" not in text_weights)
    try:
        return LlamaModel(text_config, text_weights, dtype, device=device, weight_format=fmt, tp=tp)
    except KeyError as exc:
        raise ModelLoadError(f"{model_dir}: missing tensor {exc}"
                             " (language model names are given without 'text_model.')") from None


def synthetic_vision_weights(config: VisionConfig, seed: int, projection_std: float) -> dict[str, torch.Tensor]:
    """N(0, 0.02²) weights (SigLIP's init), zero biases, identity norms; projection std ``projection_std``."""
    g = torch.Generator().manual_seed(seed)
    d, inter, c, p = config.hidden_size, config.intermediate_size, config.num_channels, config.patch_size

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(shape, generator=g) * std

    v = VISION_PREFIX
    weights = {
        v + "embeddings.patch_embedding.weight": normal(d, c, p, p),
        v + "embeddings.patch_embedding.bias": torch.zeros(d),
        v + "embeddings.position_embedding.weight": normal(config.patches_per_side ** 2, d),
        v + "post_layernorm.weight": torch.ones(d),
        v + "post_layernorm.bias": torch.zeros(d),
    }
    for i in range(config.num_hidden_layers):
        layer = f"{v}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            weights[f"{layer}self_attn.{name}.weight"] = normal(d, d)
            weights[f"{layer}self_attn.{name}.bias"] = torch.zeros(d)
        weights[layer + "mlp.fc1.weight"], weights[layer + "mlp.fc1.bias"] = normal(inter, d), torch.zeros(inter)
        weights[layer + "mlp.fc2.weight"], weights[layer + "mlp.fc2.bias"] = normal(d, inter), torch.zeros(d)
        for norm in ("layer_norm1", "layer_norm2"):
            weights[f"{layer}{norm}.weight"], weights[f"{layer}{norm}.bias"] = torch.ones(d), torch.zeros(d)
    weights[CONNECTOR_WEIGHT] = normal(
        config.text_hidden_size, d * config.scale_factor ** 2, std=projection_std)
    return weights


def default_multimodal_model(seed: int = DEFAULT_SEED) -> Path:
    """Written once under the cache; the tokenizer gains ``SPECIAL_TOKENS``, the embedding a row each (mean + 1%
    seeded noise: text outputs equal SmolLM2's). Raises ModelLoadError."""
    base = default_text_dir()
    return cached_dir(cache_root() / f"{base.name}-smolvlm-synthetic-seed{seed}",
                      lambda tmp: _write_synthetic_dir(tmp, base, seed))


def _write_synthetic_dir(out: Path, base: Path, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    text_cfg = json.loads((base / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.save_pretrained(out)
    vocab = len(tokenizer)

    g = torch.Generator().manual_seed(seed + 1)
    weights = {}
    for name, tensor in read_weights(base).items():
        if name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < vocab:
            noise = torch.randn(vocab - tensor.shape[0], tensor.shape[1], generator=g) * tensor.float().std() * 0.01
            tensor = torch.cat([tensor, (tensor.float().mean(0) + noise).to(tensor.dtype)])
        weights[("model.text_model." + name[len("model."):]) if name.startswith("model.") else name] = tensor
    text_cfg["vocab_size"] = vocab

    cfg = {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        "scale_factor": SMOLVLM_256M_SCALE_FACTOR,
        "tie_word_embeddings": text_cfg.get("tie_word_embeddings", False),
        "text_config": text_cfg,
        "vision_config": SMOLVLM_256M_VISION,
        "synthetic_vision": True,
        "synthetic_vision_seed": seed,
    }
    vision_config = VisionConfig.from_dict(cfg)
    embed_std = float(weights["model.text_model.embed_tokens.weight"].float().std())
    fan_in = vision_config.hidden_size * vision_config.scale_factor ** 2
    weights.update(synthetic_vision_weights(vision_config, seed, projection_std=embed_std / fan_in ** 0.5))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    processor = ImageProcessor(longest_edge=DEFAULT_LONGEST_EDGE, max_image_size=vision_config.image_size,
                               image_seq_len=vision_config.tokens_per_image)
    (out / "preprocessor_config.json").write_text(json.dumps(processor.to_config(), indent=2))
    (out / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": vision_config.tokens_per_image, "processor_class": "Idefics3Processor"}, indent=2))
