"""Accelerator profiles for the roofline: vendors' datasheet peaks (dense BF16, memory bandwidth
and size, per-direction links); efficiencies are the share of a peak a serving engine reaches
(as in AIConfigurator's and DistServe's analytic models); prices are indicative USD/h for
ranking only (``--price-per-hour``)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Device:
    """``peak_tflops`` dense BF16 (fp32 for CPUs); bandwidths in GB/s (10^9 B/s), link per
    direction within a node, ``net_gbs`` between nodes; ``memory_gb`` for weights and KV;
    ``step_overhead_ms``: scheduling and launches per step; ``dtype_bytes`` per weight and KV element."""

    name: str
    peak_tflops: float
    mem_bw_gbs: float
    memory_gb: float
    link_gbs: float
    link_latency_ms: float
    net_gbs: float
    price_per_hour: float
    compute_eff: float = 0.6
    bw_eff: float = 0.75
    step_overhead_ms: float = 4.0
    dtype_bytes: int = 2


# NVLink per direction: A100 300 GB/s, H100/H200 450 GB/s, B200 900 GB/s; L40S has no
# NVLink (PCIe Gen4 x16, ~32 GB/s per direction). Between nodes: 400 Gb/s InfiniBand.
PROFILES: dict[str, Device] = {d.name: d for d in (
    Device("A100", peak_tflops=312, mem_bw_gbs=2039, memory_gb=80, link_gbs=300,
           link_latency_ms=0.01, net_gbs=50, price_per_hour=1.8),
    Device("H100", peak_tflops=989, mem_bw_gbs=3350, memory_gb=80, link_gbs=450,
           link_latency_ms=0.01, net_gbs=50, price_per_hour=3.0),
    Device("H200", peak_tflops=989, mem_bw_gbs=4800, memory_gb=141, link_gbs=450,
           link_latency_ms=0.01, net_gbs=50, price_per_hour=3.8),
    Device("L40S", peak_tflops=362, mem_bw_gbs=864, memory_gb=48, link_gbs=32,
           link_latency_ms=0.02, net_gbs=25, price_per_hour=1.0),
    Device("B200", peak_tflops=2250, mem_bw_gbs=8000, memory_gb=180, link_gbs=900,
           link_latency_ms=0.01, net_gbs=50, price_per_hour=6.0),
)}


PRECISIONS = ("bf16", "fp8")


def device(name: str, precision: str = "bf16", **overrides) -> Device:
    """Case-insensitive; FP8 halves the bytes and doubles the dense peak, as the datasheets list.

    Raises ValueError naming the known profiles or precisions."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    for key, dev in PROFILES.items():
        if key.lower() == name.lower():
            if precision == "fp8":
                dev = replace(dev, peak_tflops=dev.peak_tflops * 2, dtype_bytes=1)
            return replace(dev, **overrides)
    raise ValueError(f"unknown hardware {name!r} (known: {', '.join(PROFILES)}; "
                     f"or 'cpu' after `epdserve plan calibrate`)")
