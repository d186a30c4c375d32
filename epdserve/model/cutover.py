"""How many rows a step may have and still run a linear layer on the GGUF block kernel rather
than the BLAS: measured on this machine, on the engine's threads, once, and kept.

The answer depends on the CPU far more than on the model. On a 2-core AVX-512 + AMX Xeon,
a step's projections of SmolLM2-135M (all 30 layers) ran faster on a resident float32 copy
(MKL's sgemm) than on the block kernel from 48 rows, on dequantize + sgemm from 96, on a
resident bfloat16 copy (AMX) from 16 (``benchmarks/linear_cutover.py``); on a one-thread
AVX2 CPU the kernel held against dequantize + sgemm up to 256 rows. So the first model load
with blocks on a machine times every layer's projections both ways at :data:`ROWS` (~5 s;
one layer alone stays in the CPU's cache and flatters the dense copy) and writes the answer
to ``<cache>/cutover/<key>.json``, keyed by the CPU, the thread count, the layers' count
and shapes, the dense format and the kernels' build (sources, flags, torch's version);
later loads read it (delete the file
to measure again). Workers starting together measure once: the others wait on a lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from typing import Callable, Sequence

import torch

from epdserve.model import kernels
from epdserve.model.base import cache_root

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
REPS = 3  # timed calls per way and row count, after one untimed; the best counts


def kernel_rows_for(times: dict[int, tuple[float, float]]) -> int:
    """The most rows that run on the kernel, from ``{rows: (kernel s, BLAS s)}``: the
    largest measured row count below the first from which the BLAS is faster at every
    larger one (0: the BLAS always; ``max(ROWS)`` when it never overtakes)."""
    rows = sorted(times)
    blas_from = None
    for m in reversed(rows):
        if times[m][1] >= times[m][0]:
            break
        blas_from = m
    if blas_from is None:
        return rows[-1]
    below = [m for m in rows if m < blas_from]
    return below[-1] if below else 0


def _best(fn: Callable[[], object]) -> float:
    fn()
    best = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(kernel: Callable[[int], object], blas: Callable[[int], object]) -> dict[int, tuple[float, float]]:
    """``{rows: (best s of kernel(rows), best s of blas(rows))}`` over :data:`ROWS`."""
    return {rows: (_best(lambda: kernel(rows)), _best(lambda: blas(rows))) for rows in ROWS}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    import platform

    return kernels.cpuinfo("model name") or platform.processor() or platform.machine()


def kernel_rows(kernel: Callable[[int], object], blas: Callable[[int], object], key: Sequence) -> int:
    """:func:`kernel_rows_for` of :func:`measure` (``kernel(rows)`` and ``blas(rows)`` run
    a step of ``rows`` rows each way), read from the cache when this machine answered it
    before for ``key`` (the layer's shapes and formats; the CPU, the thread count and the
    kernels' build are added here)."""
    parts = [cpu_name(), torch.get_num_threads(), kernels.digest(), *key]
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    path = cache_root() / "cutover" / f"{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return int(json.loads(path.read_text())["kernel_rows"])
        times = measure(kernel, blas)
        rows = kernel_rows_for(times)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": parts, "kernel_rows": rows,
                                   "times_ms": {m: [t * 1e3 for t in ts] for m, ts in times.items()}}))
        tmp.rename(path)
    log.info("block kernel up to %d rows, the BLAS above (measured on %d threads; %s)", rows,
             torch.get_num_threads(), path)
    return rows
