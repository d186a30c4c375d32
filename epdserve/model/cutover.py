"""Rows up to which a step runs a linear layer on the GGUF block kernel rather than the BLAS, measured per
machine (``tuning.py``): on a 2-core AMX Xeon the BLAS won from 48 rows on a float32 copy, 16 on bfloat16;
on a one-thread AVX2 CPU the kernel held to 256 (``benchmarks/linear_cutover.py``)."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from epdserve.model import tuning

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
WAYS = ("kernel", "blas")


def kernel_rows_for(times: dict[int, tuple[float, float]]) -> int:
    """From ``{rows: (kernel s, BLAS s)}``: the largest row count below the one from which the BLAS wins at
    every larger count (0: always the BLAS; ``max(ROWS)``: never)."""
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
    return f"{way}@{rows}"


def decide(seconds: Mapping[str, float]) -> int:
    return kernel_rows_for({m: tuple(seconds[candidate(w, m)] for w in WAYS) for m in ROWS})


def measure(kernel: Callable[[int], object], blas: Callable[[int], object]) -> tuning.Attempt:
    ways = dict(zip(WAYS, (kernel, blas)))
    return tuning.time_rounds({candidate(w, m): (lambda f=ways[w], m=m: f(m)) for m in ROWS for w in WAYS})


def kernel_rows(kernel: Callable[[int], object], blas: Callable[[int], object], key: Sequence,
                force: bool = False) -> tuning.Tuned:
    """``key``: the layers' shapes and formats; ``kernel(rows)``/``blas(rows)`` run a step each way."""
    return tuning.choose("cutover", key, lambda: measure(kernel, blas), decide, valid, force)


def valid(value: object) -> bool:
    """0 or one of :data:`ROWS`."""
    return type(value) is int and value in (0, *ROWS)
