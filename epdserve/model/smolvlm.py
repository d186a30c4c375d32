"""SmolVLM / Idefics3: a Hugging Face directory → vision encoder + Llama language model,
and the default multimodal model.

A directory is used as it is: ``config.json`` with ``model_type`` idefics3 or smolvlm,
``vision_config``, ``text_config``, ``scale_factor`` and ``image_token_id``; safetensors
named ``model.vision_model.*``, ``model.connector.*``, ``model.text_model.*`` and
``lm_head.weight`` (absent when tied); tokenizer files with the image special tokens.

No vision weights can be downloaded here, so the default multimodal model
(:func:`default_multimodal_model`) is the real SmolLM2-135M-Instruct language model (the
default GGUF) plus a SmolVLM-256M-shaped vision tower (SigLIP base patch16/512, pixel
shuffle 4, 64 tokens per tile) with seeded synthetic weights; its ``config.json`` says
``"synthetic_vision": true`` so that the serving layers can say so.
"""

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
# SmolVLM-256M resizes to a 2048-pixel longest edge (up to 16 tiles + 1); the default model
# uses one 512-pixel tile per image (longest edge 512) so that encoding stays affordable on CPU.
DEFAULT_LONGEST_EDGE = 512
DEFAULT_SEED = 0


@dataclass
class SmolVLM:
    """A loaded vision-language model: ``vision`` (tiles → ``[N, tokens_per_image,
    hidden]``), ``text`` (the language model over the paged KV cache), ``processor``
    (image preprocessing and prompt expansion), the ``image_token_id`` whose positions
    take image embeddings, and ``synthetic_vision`` (True: the vision weights are random,
    image outputs carry no meaning)."""

    path: Path
    vision: VisionEncoder
    text: LlamaModel
    processor: ImageProcessor
    image_token_id: int
    synthetic_vision: bool

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> "SmolVLM":
        """Load a SmolVLM / Idefics3 Hugging Face directory, both towers on ``device``.

        Raises:
            ModelLoadError: wrong model type, unreadable or missing weights.
        """
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
        """Idefics3's ``inputs_merger`` as an override for :meth:`LlamaModel.forward`:
        the rows of ``input_ids [T]`` holding ``image_token_id`` and the image embeddings
        ``[N, tokens_per_image, hidden]`` flattened in order, ``(rows [R], values [R, hidden])``.

        Raises:
            ValueError: the number of image tokens differs from the number of embeddings.
        """
        rows = (input_ids == self.image_token_id).nonzero().flatten()
        values = embeddings.reshape(-1, embeddings.shape[-1])
        if len(rows) != len(values):
            raise ValueError(f"{len(rows)} {IMAGE_TOKEN} tokens for {len(values)} image embeddings")
        return rows, values


def load_text(model_dir: str | Path, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", weight_format: str = "auto",
              tp: tensor_parallel.TPRank | None = None) -> tuple[LlamaModel, int]:
    """The language model of a SmolVLM / Idefics3 directory alone (what prefill and decode
    workers run; the vision tower stays unread), on ``device``, its linear layers dense in
    ``weight_format`` (``model/linear.py``: there are no GGUF blocks), and its ``image_token_id``.
    With ``tp``, the rank's shard (see ``LlamaModel``).

    Raises:
        ModelLoadError: as :meth:`SmolVLM.load`.
        ValueError: a weight format with blocks (``linear.resolve``); with ``tp``, a TP size
            the model cannot split.
    """
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
    """Seeded random SigLIP + connector weights (Hugging Face names) for ``config``.

    Linear, conv and position weights are N(0, 0.02²) (SigLIP's initializer range),
    biases 0, LayerNorms identity; the projection is N(0, ``projection_std``²) so that
    image embeddings have a spread like the language model's token embeddings and
    activations stay finite. Same ``seed`` → same tensors.
    """
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
    """The default multimodal model's Hugging Face directory, written once under the
    cache (``$EPDSERVE_CACHE`` or ``~/.cache/epdserve``) next to the default text model.

    It is SmolLM2-135M-Instruct (weights untouched) plus a SmolVLM-256M-shaped vision
    tower with SYNTHETIC weights from :func:`synthetic_vision_weights` (``seed``). The
    tokenizer gains SmolVLM's image special tokens (``SPECIAL_TOKENS``) as added tokens,
    and the embedding (and ``lm_head`` when untied) gains one SYNTHETIC row per new token:
    the mean token embedding plus seeded noise of 1% of the embeddings' spread, so that
    no new token outscores real ones and text-only outputs equal SmolLM2's.

    Raises:
        ModelLoadError: the default text model cannot be found or read.
    """
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
