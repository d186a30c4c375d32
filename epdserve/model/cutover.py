"""How many rows a step may have and still run a linear layer on the GGUF block kernel rather
than the BLAS: measured on this machine, on the engine's threads, and kept (``tuning.py``:
a measurement disturbed by other processes is measured again, or kept marked disturbed).

The answer depends on the CPU far more than on the model. On a 2-core AVX-512 + AMX Xeon,
a step's projections of SmolLM2-135M (all 30 layers) ran faster on a resident float32 copy
(MKL's sgemm) than on the block kernel from 48 rows, on dequantize + sgemm from 96, on a
resident bfloat16 copy (AMX) from 16 (``benchmarks/linear_cutover.py``); on a one-thread
AVX2 CPU the kernel held against dequantize + sgemm up to 256 rows. So the first model load
with blocks on a machine times every layer's projections both ways at :data:`ROWS` (~5-10 s;
one layer alone stays in the CPU's cache and flatters the dense copy).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from epdserve.model import tuning

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WAYS = ("kernel", "blas")


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


def candidate(way: str, rows: int) -> str:
    """A timed candidate's name, ``kernel@32``."""
    return f"{way}@{rows}"


def decide(seconds: Mapping[str, float]) -> int:
    """:func:`kernel_rows_for` of ``{candidate(way, rows): s}`` over :data:`ROWS`."""
    return kernel_rows_for({m: tuple(seconds[candidate(w, m)] for w in WAYS) for m in ROWS})


def measure(kernel: Callable[[int], object], blas: Callable[[int], object]) -> tuning.Attempt:
    """One attempt (``tuning.time_rounds``) of ``kernel(rows)`` and ``blas(rows)`` at every
    row count of :data:`ROWS`, each row count's two ways in turn."""
    ways = dict(zip(WAYS, (kernel, blas)))
    return tuning.time_rounds({candidate(w, m): (lambda f=ways[w], m=m: f(m)) for m in ROWS for w in WAYS})


def kernel_rows(kernel: Callable[[int], object], blas: Callable[[int], object], key: Sequence,
                force: bool = False) -> tuning.Tuned:
    """The cut-over for layers of ``key`` (their shapes and formats), whose steps of ``rows``
    rows ``kernel(rows)`` and ``blas(rows)`` run each way: :func:`decide` of :func:`measure`,
    through ``tuning.choose`` (kept per machine; ``force``: measured again)."""
    return tuning.choose("cutover", key, lambda: measure(kernel, blas), decide, valid, force)


def valid(value: object) -> bool:
    """Whether ``value`` is a cut-over :func:`decide` can give (0 or one of :data:`ROWS`)."""
    return type(value) is int and value in (0, *ROWS)
