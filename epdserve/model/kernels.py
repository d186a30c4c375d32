"""The engine's C++ kernels: built on first use, loaded once per process.

``quant_kernels.cpp`` (matmuls on GGUF weight blocks, see ``quant.py``) and
``layer_kernels.cpp`` (fused RMSNorm, RoPE + KV write, paged decode attention, see
``layer_ops.py``) need AVX2 and FMA; ``layer_kernels_avx512.cpp`` and
``prefill_attention.cpp`` are compiled for AVX-512 (and AMX) by their own target pragmas and
run only where the CPU has it (``layer_kernels.cpp`` checks; ``prefill_attention.ways``
reads :func:`cpu_flags`). They are compiled together with
``torch.utils.cpp_extension`` (~30 s) into ``<cache>/torch_extensions``, one directory per
sources, flags and torch version, and register their operators as ``torch.ops.epdserve.*``.
Without AVX2/FMA, or when the build fails, :func:`available` logs one line and returns
False; the model then keeps float32 weights and the PyTorch operators.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
from pathlib import Path

import torch

from epdserve.model.base import cache_root, cached_dir

log = logging.getLogger(__name__)

SOURCES = ("quant_kernels.cpp", "layer_kernels.cpp", "layer_kernels_avx512.cpp", "prefill_attention.cpp")
HEADERS = ("avx512.h",)  # included by the sources: part of the build's digest
# -fopenmp compiles at::parallel_for to torch's OpenMP thread pool (its libgomp comes in
# through libtorch_cpu); without it the loops run on one thread. -ffp-contract=off keeps
# a * b + c as two roundings where the kernels mirror PyTorch's arithmetic.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off")

_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """Build (first call in a process) and load the kernels; False, with one log line, when
    the CPU lacks AVX2 or FMA or the build fails."""
    global _loaded
    if _loaded is None:
        _loaded = _build()
    return _loaded


def cpuinfo(*keys: str) -> str | None:
    """The value of the first Linux ``/proc/cpuinfo`` line whose key is one of ``keys``;
    None when there is none (or no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines
                 if ":" in line and line.split(":", 1)[0].strip() in keys), None)


def cpu_model() -> str:
    """This CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    import platform

    return cpuinfo("model name") or platform.processor() or platform.machine()


# The flags that decide which kernels run fastest here: printed beside every measured choice.
SPEED_FLAGS = frozenset({"avx2", "fma", "avx512f", "amx_tile", "avx512_bf16", "amx_bf16", "bf16"})


def speed_flags() -> list[str]:
    """This CPU's :data:`SPEED_FLAGS`, sorted."""
    return sorted(cpu_flags() & SPEED_FLAGS)


def cpu_flags() -> set[str]:
    """This CPU's feature flags: ``/proc/cpuinfo``'s ``flags`` line (x86) or ``Features``
    line (Arm); empty elsewhere."""
    return set((cpuinfo("flags", "Features") or "").split())


def cpu_supported() -> bool:
    """Whether this CPU has AVX2 and FMA (:func:`cpu_flags`; False elsewhere)."""
    return {"avx2", "fma"} <= cpu_flags()


def digest() -> str:
    """12 hex digits naming this build: the sources, the flags and torch's version."""
    h = hashlib.sha256(b"".join(Path(__file__).with_name(name).read_bytes() for name in SOURCES + HEADERS))
    h.update(" ".join(FLAGS + (torch.__version__,)).encode())
    return h.hexdigest()[:12]


def _build() -> bool:
    if not cpu_supported():
        log.info("C++ kernels off: this CPU lacks AVX2/FMA; using float32 weights and PyTorch operators")
        return False
    from torch.utils.cpp_extension import load  # heavy: only when the kernels are built

    sources = [Path(__file__).with_name(name) for name in SOURCES]
    built_here = []

    def build(tmp: Path) -> None:
        load(name="epdserve_kernels", sources=[str(s) for s in sources], extra_cflags=list(FLAGS),
             build_directory=str(tmp), is_python_module=False)  # also loads it
        built_here.append(True)

    out = cache_root() / "torch_extensions" / f"epdserve_kernels-{digest()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Workers starting together build once: the others wait on an flock, which the OS
        # releases if the builder dies (torch's own lock file would then stay and block
        # every later start). The build goes to a private directory renamed into place.
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached_dir(out, build)
        if not built_here:
            torch.ops.load_library(str(out / "epdserve_kernels.so"))
    except Exception as exc:  # compiler missing, build error, load error: keep serving
        log.warning("C++ kernels off: build failed (%s: %s); using float32 weights and PyTorch operators",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True
