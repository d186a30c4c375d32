"""Idefics3 / SmolVLM vision side in plain PyTorch: the SigLIP vision transformer and the
pixel-shuffle connector that turns each image tile into ``tokens_per_image`` embeddings
in the language model's hidden size.

The maths follows transformers' ``modeling_idefics3`` / ``modeling_smolvlm`` (Conv2d
patch embedding, NaViT-style bucketed position ids, pre-LayerNorm encoder layers with
bidirectional multi-head attention and a GELU-tanh MLP, post-LayerNorm, pixel shuffle,
bias-free projection) so that embeddings match it to float rounding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from epdserve.model.base import MULTIMODAL_MODEL_TYPES, ModelLoadError

VISION_PREFIX = "model.vision_model."
CONNECTOR_WEIGHT = "model.connector.modality_projection.proj.weight"


def is_vision_weight(name: str) -> bool:
    """True for the Hugging Face tensor names of the vision tower and connector."""
    return name.startswith((VISION_PREFIX, "model.connector."))


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP tower and connector shape (Hugging Face Idefics3 field names).

    ``image_size`` and ``patch_size`` in pixels; ``scale_factor`` the pixel-shuffle
    factor; ``text_hidden_size`` the language model's hidden size (the projection output).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    scale_factor: int
    text_hidden_size: int
    num_channels: int = 3

    @classmethod
    def from_dict(cls, cfg: dict) -> "VisionConfig":
        """From a whole Idefics3/SmolVLM ``config.json`` dict (``vision_config``,
        ``text_config`` and ``scale_factor``)."""
        v = cfg["vision_config"]
        return cls(
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_hidden_layers=v["num_hidden_layers"],
            num_attention_heads=v["num_attention_heads"],
            image_size=v["image_size"],
            patch_size=v["patch_size"],
            layer_norm_eps=v.get("layer_norm_eps", 1e-6),
            scale_factor=cfg.get("scale_factor", 2),
            text_hidden_size=cfg["text_config"]["hidden_size"],
            num_channels=v.get("num_channels", 3),
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """Embeddings per ``image_size`` tile after the pixel shuffle (Idefics3's
        ``image_seq_len``: 64 for SmolVLM-256M's 512-pixel tiles, patch 16, factor 4)."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2


class VisionEncoder:
    """SigLIP vision transformer + Idefics3 connector. Build with :meth:`load` (a
    directory) or the constructor (a weights dict and a :class:`VisionConfig`)."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        """``weights`` uses Hugging Face names (``model.vision_model.*`` and
        ``model.connector.modality_projection.proj.weight``); extra names are ignored.
        ``device``: where the weights live and :meth:`encode` computes.

        Raises:
            KeyError: a tensor is missing.
        """
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return weights[VISION_PREFIX + name].to(self.device, dtype)

        self.patch_weight = w("embeddings.patch_embedding.weight")
        self.patch_bias = w("embeddings.patch_embedding.bias")
        self.position = w("embeddings.position_embedding.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"encoder.layers.{i}."
            # One matmul for Q, K and V.
            self.layers.append({
                "ln1": (w(p + "layer_norm1.weight"), w(p + "layer_norm1.bias")),
                "ln2": (w(p + "layer_norm2.weight"), w(p + "layer_norm2.bias")),
                "qkv": torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
                "qkv_bias": torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
                "out": (w(p + "self_attn.out_proj.weight"), w(p + "self_attn.out_proj.bias")),
                "fc1": (w(p + "mlp.fc1.weight"), w(p + "mlp.fc1.bias")),
                "fc2": (w(p + "mlp.fc2.weight"), w(p + "mlp.fc2.bias")),
            })
        self.post_norm = (w("post_layernorm.weight"), w("post_layernorm.bias"))
        self.projection = weights[CONNECTOR_WEIGHT].to(self.device, dtype)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> "VisionEncoder":
        """Load only the vision side of a SmolVLM / Idefics3 Hugging Face directory (an
        encode worker needs no language model). From a weights dict, use the constructor.

        Raises:
            ModelLoadError: not a vision-language model, unreadable weights or a missing tensor.
        """
        config = VisionConfig.from_dict(read_config(model_dir))
        weights = read_weights(model_dir, is_vision_weight)
        try:
            return cls(config, weights, dtype, device)
        except KeyError as exc:
            raise ModelLoadError(f"{model_dir}: missing vision tensor {exc}") from None

    def position_ids(self, patches_h: int, patches_w: int) -> torch.Tensor:
        """Position-embedding index ``[patches_h * patches_w]`` of each patch of an
        unpadded image: fractional patch coordinates bucketed onto the
        ``patches_per_side``² grid the embeddings were trained on (NaViT, as
        transformers' ``Idefics3VisionEmbeddings``); the identity for a full
        ``image_size`` tile. On the encoder's device, computed on the host: bucketing
        compares floats at exact boundaries, so every device gets the CPU's buckets."""
        side = self.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)

        def buckets(n: int) -> torch.Tensor:
            coords = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(float(n))),
                                 max=1.0 - 1e-6)
            return torch.bucketize(coords, boundaries, right=True)

        return (buckets(patches_h)[:, None] * side + buckets(patches_w)[None, :]).flatten().to(self.device)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Embeddings of image tiles.

        Args:
            pixel_values: ``[N, 3, H, W]`` normalised tiles (see
                :class:`epdserve.model.image_processor.ImageProcessor`), no padding;
                ``H`` and ``W`` multiples of ``patch_size`` (normally both ``image_size``);
                on any device (moved to the encoder's).
        Returns:
            ``[N, tokens_per_image, text_hidden_size]`` in ``self.dtype`` on the encoder's
            device (not waited for on CUDA), one row per ``<image>`` token, in the order
            Idefics3 scatters them into the prompt.
        """
        c = self.config
        n, _, height, width = pixel_values.shape
        x = F.conv2d(pixel_values.to(self.device, self.dtype), self.patch_weight, self.patch_bias,
                     stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2)  # [N, patches, hidden]
        x = x + self.position[self.position_ids(height // c.patch_size, width // c.patch_size)]
        heads, head_dim = c.num_attention_heads, c.hidden_size // c.num_attention_heads
        for layer in self.layers:
            h = F.layer_norm(x, (c.hidden_size,), *layer["ln1"], eps=c.layer_norm_eps)
            q, k, v = (F.linear(h, layer["qkv"], layer["qkv_bias"])
                       .view(n, -1, 3, heads, head_dim).permute(2, 0, 3, 1, 4))
            attn = F.scaled_dot_product_attention(q, k, v)  # bidirectional, scale 1/sqrt(d)
            x = x + F.linear(attn.transpose(1, 2).reshape(n, -1, c.hidden_size), *layer["out"])
            h = F.layer_norm(x, (c.hidden_size,), *layer["ln2"], eps=c.layer_norm_eps)
            h = F.gelu(F.linear(h, *layer["fc1"]), approximate="tanh")
            x = x + F.linear(h, *layer["fc2"])
        x = F.layer_norm(x, (c.hidden_size,), *self.post_norm, eps=c.layer_norm_eps)
        return F.linear(pixel_shuffle(x, c.scale_factor), self.projection)


def read_config(model_dir: str | Path) -> dict:
    """The ``config.json`` dict of a SmolVLM / Idefics3 directory.

    Raises:
        ModelLoadError: missing or unreadable file, or not a multimodal ``model_type``.
    """
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc})") from None
    if cfg.get("model_type") not in MULTIMODAL_MODEL_TYPES:
        raise ModelLoadError(f"{path}: not a vision-language model, model_type={cfg.get('model_type')!r}"
                             f" (supported: {', '.join(MULTIMODAL_MODEL_TYPES)})")
    return cfg


def read_weights(model_dir: str | Path, keep: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The tensors of every ``*.safetensors`` file in ``model_dir`` whose name passes ``keep``.

    Raises:
        ModelLoadError: no weight file, or a corrupt one.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    weights = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                weights.update({k: f.get_tensor(k) for k in f.keys() if keep(k)})
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from None
    return weights


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Idefics3's space-to-depth: ``[N, side², D]`` patch features (row-major grid)
    become ``[N, side² / factor², D * factor²]``; each output token concatenates a
    ``factor × factor`` block of neighbouring patches, in the element order of
    transformers' ``Idefics3Connector.pixel_shuffle`` (which the projection weights
    assume)."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.reshape(n, side, side // factor, dim * factor)        # merge `factor` columns
    x = x.transpose(1, 2).reshape(n, side // factor, side // factor, dim * factor * factor)
    return x.transpose(1, 2).reshape(n, seq // factor ** 2, dim * factor * factor)
