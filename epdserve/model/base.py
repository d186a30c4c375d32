"""What every model module shares: the error a model that cannot be loaded raises, the
model types served, and the on-disk cache (``$EPDSERVE_CACHE`` or ``~/.cache/epdserve``)
that converted models and built kernels live in."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
MULTIMODAL_MODEL_TYPES = ("idefics3", "smolvlm")


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the file and the reason."""


def cache_root() -> Path:
    return Path(os.environ.get("EPDSERVE_CACHE", Path.home() / ".cache" / "epdserve"))


def cached_dir(out: Path, write) -> Path:
    """``out``, built once by ``write(tmp_dir)`` if it is not complete yet. ``write`` fills a
    private temporary directory that is renamed into place, so workers starting together
    never read a half-written one; whatever ``write`` raises propagates (the temporary
    directory is removed)."""
    if (out / "complete").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "complete").touch()
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
