"""Shared by the model modules: the load error, the served model types, and the on-disk cache
(``$EPDSERVE_CACHE`` or ``~/.cache/epdserve``)."""

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
    """Built once by ``write(tmp_dir)`` in a private directory renamed into place (concurrent starters never
    read a half-written one); ``write``'s errors propagate."""
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
