"""Idefics3 / SmolVLM vision side (SigLIP, pixel-shuffle connector) matching transformers'
``modeling_idefics3``. Tensor parallel (``--encode-tp``, Megatron-LM): heads and MLP features split evenly,
``out_proj``/``fc2`` row-parallel (two all-reduces a layer), the rest replicated."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from epdserve.model.base import MULTIMODAL_MODEL_TYPES, ModelLoadError
from epdserve.model.tensor_parallel import TPRank, even_range, take

VISION_PREFIX = "model.vision_model."
CONNECTOR_WEIGHT = "model.connector.modality_projection.proj.weight"


def is_vision_weight(name: str) -> bool:
    return name.startswith((VISION_PREFIX, "model.connector."))


@dataclass(frozen=True)
class VisionConfig:
    """Hugging Face Idefics3 field names; sizes in pixels."""

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
        """Idefics3's ``image_seq_len`` (SmolVLM-256M: 512 px tiles, patch 16, factor 4 → 64)."""
        return self.patches_per_side ** 2 // self.scale_factor ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def vision_shard(config: VisionConfig, rank: int, size: int) -> tuple[range, range]:
    """Rank ``rank``'s heads and MLP features. Raises ValueError: ``size`` outside 1..heads, or a bad ``rank``."""
    heads = config.num_attention_heads
    if not 1 <= size <= heads:
        raise ValueError(f"tensor parallel size {size} of the vision tower: it must be between 1 and its "
                         f"{heads} attention heads (each rank needs one)")
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} is outside [0, {size})")
    return even_range(heads, size, rank), even_range(config.intermediate_size, size, rank)


class VisionEncoder:
    """SigLIP encoder + Idefics3 connector, or one rank's shard of it."""

    def __init__(self, config: VisionConfig, weights: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tp: TPRank | None = None):
        """``tp``: this rank (every rank must :meth:`encode` the same tiles). Raises KeyError, ValueError."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp = tp
        heads, inter = vision_shard(config, tp.rank, tp.size) if tp else (range(config.num_attention_heads),
                                                                         range(config.intermediate_size))
        self.num_heads = len(heads)

        def w(name: str, r: range | None = None, per: int = 1, dim: int = 0) -> torch.Tensor:
            t = weights[VISION_PREFIX + name]
            return (t if r is None or tp is None else take(t, r, per, dim)).to(self.device, dtype)

        d = config.head_dim
        self.patch_weight = w("embeddings.patch_embedding.weight")
        self.patch_bias = w("embeddings.patch_embedding.bias")
        self.position = w("embeddings.position_embedding.weight")
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"encoder.layers.{i}."
            self.layers.append({
                "ln1": (w(p + "layer_norm1.weight"), w(p + "layer_norm1.bias")),
                "ln2": (w(p + "layer_norm2.weight"), w(p + "layer_norm2.bias")),
                "qkv": torch.cat([w(p + f"self_attn.{n}_proj.weight", heads, d) for n in "qkv"]),
                "qkv_bias": torch.cat([w(p + f"self_attn.{n}_proj.bias", heads, d) for n in "qkv"]),
                "out": (w(p + "self_attn.out_proj.weight", heads, d, 1), w(p + "self_attn.out_proj.bias")),
                "fc1": (w(p + "mlp.fc1.weight", inter), w(p + "mlp.fc1.bias", inter)),
                "fc2": (w(p + "mlp.fc2.weight", inter, 1, 1), w(p + "mlp.fc2.bias")),
            })
        self.post_norm = (w("post_layernorm.weight"), w("post_layernorm.bias"))
        self.projection = weights[CONNECTOR_WEIGHT].to(self.device, dtype)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", tp: TPRank | None = None) -> "VisionEncoder":
        """The vision side only. Raises ModelLoadError (not a VLM, unreadable or missing weights), ValueError."""
        config = VisionConfig.from_dict(read_config(model_dir))
        weights = read_weights(model_dir, is_vision_weight)
        try:
            return cls(config, weights, dtype, device, tp)
        except KeyError as exc:
            raise ModelLoadError(f"{model_dir}: missing vision tensor {exc}") from None

    def position_ids(self, patches_h: int, patches_w: int) -> torch.Tensor:
        """``[patches_h * patches_w]``: fractional patch coordinates bucketed onto the trained grid (NaViT, as
        ``Idefics3VisionEmbeddings``), on the host so that every device gets the CPU's buckets."""
        side = self.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)

        def buckets(n: int) -> torch.Tensor:
            coords = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(float(n))),
                                 max=1.0 - 1e-6)
            return torch.bucketize(coords, boundaries, right=True)

        return (buckets(patches_h)[:, None] * side + buckets(patches_w)[None, :]).flatten().to(self.device)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, 3, H, W]`` normalised tiles (any device) → ``[N, tokens_per_image, text_hidden_size]`` on the
        encoder's device (not synchronised), in Idefics3's prompt order."""
        c = self.config
        n, _, height, width = pixel_values.shape
        x = F.conv2d(pixel_values.to(self.device, self.dtype), self.patch_weight, self.patch_bias,
                     stride=c.patch_size)
        x = x.flatten(2).transpose(1, 2)  # [N, patches, hidden]
        x = x + self.position[self.position_ids(height // c.patch_size, width // c.patch_size)]
        for layer in self.layers:
            h = F.layer_norm(x, (c.hidden_size,), *layer["ln1"], eps=c.layer_norm_eps)
            q, k, v = (F.linear(h, layer["qkv"], layer["qkv_bias"])
                       .view(n, -1, 3, self.num_heads, c.head_dim).permute(2, 0, 3, 1, 4))
            attn = F.scaled_dot_product_attention(q, k, v)  # bidirectional, scale 1/sqrt(d)
            x = x + self._row_parallel(attn.transpose(1, 2).reshape(n, -1, self.num_heads * c.head_dim),
                                       *layer["out"])
            h = F.layer_norm(x, (c.hidden_size,), *layer["ln2"], eps=c.layer_norm_eps)
            h = F.gelu(F.linear(h, *layer["fc1"]), approximate="tanh")
            x = x + self._row_parallel(h, *layer["fc2"])
        x = F.layer_norm(x, (c.hidden_size,), *self.post_norm, eps=c.layer_norm_eps)
        return F.linear(pixel_shuffle(x, c.scale_factor), self.projection)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Summed over the ranks, then the bias once."""
        if self.tp is None:
            return F.linear(x, weight, bias)
        return self.tp.all_reduce(F.linear(x, weight)) + bias


def read_config(model_dir: str | Path) -> dict:
    """Raises ModelLoadError: unreadable, or not a multimodal ``model_type``."""
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
    """Raises ModelLoadError: no weight file, or a corrupt one."""
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
    """Idefics3's space-to-depth: ``[N, side², D]`` → ``[N, side² / factor², D * factor²]``, in the element order
    of transformers' ``Idefics3Connector.pixel_shuffle`` (the projection weights assume it)."""
    n, seq, dim = x.shape
    side = int(seq ** 0.5)
    x = x.reshape(n, side, side // factor, dim * factor)        # merge `factor` columns
    x = x.transpose(1, 2).reshape(n, side // factor, side // factor, dim * factor * factor)
    return x.transpose(1, 2).reshape(n, seq // factor ** 2, dim * factor * factor)
