"""The C++ kernels (AVX2 + FMA; the AVX-512/AMX sources by target pragmas, run only where the CPU has them),
built on first use by ``torch.utils.cpp_extension`` (~30 s) into ``<cache>/torch_extensions`` per sources,
flags and torch version. Without AVX2/FMA or on a failed build: PyTorch operators, float32 weights."""

from __future__ import annotations

import fcntl
import hashlib
import logging
from pathlib import Path

import torch

from epdserve.model.base import cache_root, cached_dir

log = logging.getLogger(__name__)

SOURCES = ("quant_kernels.cpp", "quant_planes.cpp", "layer_kernels.cpp", "layer_kernels_avx512.cpp", "prefill_attention.cpp")
HEADERS = ("avx512.h",)  # included by the sources: part of the build's digest
# -fopenmp: torch's OpenMP pool (else one thread); -ffp-contract=off: a * b + c rounds twice, as PyTorch.
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off")

_loaded: bool | None = None  # None: not tried yet


def available() -> bool:
    """Builds on the first call in a process; False, logged once, without AVX2/FMA or on a failed build."""
    global _loaded
    if _loaded is None:
        _loaded = _build()
    return _loaded


def cpuinfo(*keys: str) -> str | None:
    """The first ``/proc/cpuinfo`` value for one of ``keys``; None if none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines
                 if ":" in line and line.split(":", 1)[0].strip() in keys), None)


def cpu_model() -> str:
    import platform

    return cpuinfo("model name") or platform.processor() or platform.machine()


# The flags that decide which kernels run fastest here: printed beside every measured choice.
SPEED_FLAGS = frozenset({"avx2", "fma", "avx512f", "amx_tile", "avx512_bf16", "amx_bf16", "bf16"})


def speed_flags() -> list[str]:
    return sorted(cpu_flags() & SPEED_FLAGS)


def cpu_flags() -> set[str]:
    """``/proc/cpuinfo``'s ``flags`` (x86) or ``Features`` (Arm); empty elsewhere."""
    return set((cpuinfo("flags", "Features") or "").split())


AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})  # what the AVX-512 sources need


def cpu_supported() -> bool:
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
        # An flock (released if the builder dies, unlike torch's lock file); built privately, renamed in.
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached_dir(out, build)
        if not built_here:
            torch.ops.load_library(str(out / "epdserve_kernels.so"))
    except Exception as exc:
        log.warning("C++ kernels off: build failed (%s: %s); using float32 weights and PyTorch operators",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
    return True
