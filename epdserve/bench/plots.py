"""PNG plots of a comparison (matplotlib, Agg backend: no display needed).

Each function takes the ``compare.json`` entries (``{"name", "result", ...}``) and reads
only the raw per-request arrays of the bench result (seconds, see
:mod:`epdserve.bench.metrics`), so they also work on results loaded from disk.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _ok(result: dict) -> list[int]:
    """Indices of completed requests (no error)."""
    return [i for i, e in enumerate(result["errors"]) if not e]


def ttfts_ms(result: dict) -> np.ndarray:
    """TTFT of every completed request (ms)."""
    return np.array([result["ttfts"][i] * 1000.0 for i in _ok(result)])


def itls_ms(result: dict) -> np.ndarray:
    """Every ITL gap of completed requests, pooled (ms)."""
    return np.array([g * 1000.0 for i in _ok(result) for g in result["itls"][i]])


def itl_times(result: dict) -> tuple[np.ndarray, np.ndarray]:
    """(time since start in s at which each gap ended, gap in ms) over completed requests:
    chunk k of a request arrives at start_offset + ttft + sum of its first k gaps."""
    times, gaps = [], []
    for i in _ok(result):
        t = result["start_offsets"][i] + result["ttfts"][i]
        for g in result["itls"][i]:
            t += g
            times.append(t)
            gaps.append(g * 1000.0)
    return np.array(times), np.array(gaps)


def _cdf(ax, values: np.ndarray, label: str) -> None:
    """Empirical CDF as a step function: F(x) = fraction of values <= x."""
    if values.size:
        x = np.sort(values)
        y = np.arange(1, x.size + 1) / x.size
        ax.step(np.r_[x[0], x], np.r_[0.0, y], where="post", label=f"{label} (n={x.size})")


def plot_cdf(entries: list[dict], which: str, path: str | Path) -> None:
    """CDF of TTFT (``which`` = "ttft") or pooled ITL ("itl") per configuration."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    get = ttfts_ms if which == "ttft" else itls_ms
    for e in entries:
        _cdf(ax, get(e["result"]), e["name"])
    ax.set_xlabel(f"{which.upper()} (ms)")
    ax.set_ylabel("fraction of " + ("requests" if which == "ttft" else "gaps"))
    ax.set_title(f"{which.upper()} CDF")
    if which == "itl":
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_itl_over_time(entries: list[dict], long_offsets_s: list[float],
                       path: str | Path) -> None:
    """Each ITL gap at the time (s since start) it ended, one colour per configuration,
    with the long-prompt send times as dashed vertical lines."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for e, marker in zip(entries, "o^sDv<>" * 4):
        t, g = itl_times(e["result"])
        ax.scatter(t, g, s=5, alpha=0.5, marker=marker, label=e["name"])
    for k, x in enumerate(long_offsets_s):
        ax.axvline(x, color="red", linestyle="--", linewidth=1,
                   label="long prompt sent" if k == 0 else None)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("ITL (ms)")
    ax.set_yscale("log")
    ax.set_title("Inter-token latency over time")
    ax.grid(True, alpha=0.3)
    ax.legend(markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(entries: list[dict], long_offsets_s: list[float], out_dir: str | Path) -> list[Path]:
    """Write ttft_cdf.png, itl_cdf.png and itl_over_time.png under ``out_dir``."""
    out_dir = Path(out_dir)
    paths = [out_dir / "ttft_cdf.png", out_dir / "itl_cdf.png", out_dir / "itl_over_time.png"]
    plot_cdf(entries, "ttft", paths[0])
    plot_cdf(entries, "itl", paths[1])
    plot_itl_over_time(entries, long_offsets_s, paths[2])
    return paths
