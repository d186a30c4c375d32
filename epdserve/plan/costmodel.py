"""Per-stage cost model: step time (a roofline, Williams et al., CACM 2009, or a linear fit to
calibrated steps), image encoding, KV and embedding bytes, transfers (docs/planner.md). Decodes
enter only as count, summed and longest context: a step costs O(prefill chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from epdserve.model.image_processor import ImageProcessor
from epdserve.plan.hardware import Device
from epdserve.plan.model_spec import ModelSpec

Prefill = Sequence[tuple[int, int]]  # (new tokens, cached context) per chunk


class StepModel(Protocol):
    def step_ms(self, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                decode_max_context: int = 0) -> float:
        """Time in ms of one engine step."""


def attention_keys(prefill: Prefill, num_decode: int, decode_context: int) -> float:
    """Keys attended to by the step's new tokens (causal): n·c + n(n+1)/2 per prefill
    chunk, c + 1 per decode."""
    return float(sum(n * c + n * (n + 1) / 2 for n, c in prefill) + decode_context + num_decode)


@dataclass(frozen=True)
class Roofline:
    """Roofline step time of ``model`` on ``tp`` × ``device`` (tensor parallel)."""

    model: ModelSpec
    device: Device
    tp: int = 1

    def step_ms(self, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                decode_max_context: int = 0) -> float:
        """ms: GEMMs, prefill and decode attention each the longer of FLOPs and bytes, in
        sequence as their kernels run (a memory-bound decode attention is not hidden under prefill),
        plus the all-reduces and the step overhead."""
        m, d = self.model, self.device
        tokens = sum(n for n, _ in prefill) + num_decode
        kv = m.kv_bytes_per_token(d.dtype_bytes)  # read cached, write new
        decode_keys = decode_context + num_decode
        parts = (  # (FLOPs, bytes)
            (2.0 * m.layer_params * tokens + 2.0 * m.lm_head_params * (len(prefill) + num_decode),
             (m.layer_params + m.lm_head_params) * d.dtype_bytes),
            (sum(m.attention_flops(n, c) for n, c in prefill), kv * sum(n + c for n, c in prefill)),
            (4.0 * m.num_layers * m.num_heads * m.head_dim * decode_keys, kv * decode_keys),
        )
        ms = sum(max(flops / (self.tp * d.peak_tflops * 1e12 * d.compute_eff),
                     nbytes / (self.tp * d.mem_bw_gbs * 1e9 * d.bw_eff)) * 1e3 for flops, nbytes in parts)
        return ms + self._allreduce_ms(tokens) + d.step_overhead_ms

    def _allreduce_ms(self, tokens: int) -> float:
        # Megatron TP: two all-reduces of the activations per layer; a ring moves 2(tp-1)/tp per link.
        if self.tp == 1:
            return 0.0
        d = self.device
        size = tokens * self.model.hidden_size * d.dtype_bytes
        one = 2 * (self.tp - 1) / self.tp * size / (d.link_gbs * 1e9) * 1e3 + d.link_latency_ms
        return 2 * self.model.num_layers * one


FEATURES = ("constant", "sequences", "new_tokens", "attention_keys", "decode_padded_keys")


def features(prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
             decode_max_context: int = 0) -> list[float]:
    return [1.0, float(len(prefill) + num_decode), float(sum(n for n, _ in prefill) + num_decode),
            attention_keys(prefill, num_decode, decode_context), float(num_decode * decode_max_context)]


@dataclass(frozen=True)
class LinearStep:
    """``ms = Σ coef[i] · features[i]`` (:data:`FEATURES`); coefficients ≥ 0. The padded
    decode keys: epdserve's decode attention pads every sequence to the longest (model/llama.py)."""

    coef: tuple[float, ...]

    def step_ms(self, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                decode_max_context: int = 0) -> float:
        return float(np.dot(self.coef, features(prefill, num_decode, decode_context, decode_max_context)))

    @classmethod
    def fit(cls, steps: list[tuple], ms: list[float]) -> "LinearStep":
        """Least squares weighted by relative error (75 ms decodes count as much as 5 s
        prefills); negative coefficients are dropped and the rest refitted. Raises ValueError with
        fewer steps than features."""
        if len(steps) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(steps)}")
        x = np.array([features(*step) for step in steps])
        y = np.array(ms, dtype=float)
        keep = list(range(len(FEATURES)))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones_like(y), rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = np.zeros(len(FEATURES))
        full[keep] = np.clip(coef, 0.0, None)
        return cls(tuple(float(c) for c in full))


@dataclass(frozen=True)
class Link:
    """``gbs`` in GB/s (10^9 bytes/s), ``latency_ms`` fixed."""

    gbs: float
    latency_ms: float

    def transfer_ms(self, nbytes: float) -> float:
        return nbytes / (self.gbs * 1e9) * 1e3 + self.latency_ms


@dataclass(frozen=True)
class ImageCost:
    """``encode_ms(tiles, devices)``: one encode call in ms (0 tiles: 0); ``hidden_size`` and
    ``dtype_bytes``: the embeddings' width and element size."""

    processor: ImageProcessor
    encode_ms: Callable[[int, int], float]
    hidden_size: int
    dtype_bytes: int

    def tiles(self, size: tuple[int, int]) -> int:
        """rows × cols + the global image (1 when not split)."""
        rows, cols = self.processor.grid(size)
        return rows * cols + 1

    def tokens(self, size: tuple[int, int]) -> int:
        return self.processor.num_tokens(self.processor.grid(size))

    def prompt_tokens(self, size: tuple[int, int]) -> int:
        """``<image>`` tokens plus Idefics3's markup around them and the newline joining the
        text (serving/api/multimodal.py), as SmolVLM's BPE counts them (the last row's newline and the
        blank line merge)."""
        rows, cols = self.processor.grid(size)
        markup = 2 * rows * cols + rows + 3
        return self.tokens(size) + markup + 1

    def embedding_bytes(self, size: tuple[int, int]) -> int:
        """The frame header (< 1 KB) left out."""
        return self.tokens(size) * self.hidden_size * self.dtype_bytes


def roofline_encode_ms(model: ModelSpec, device: Device, tiles: int, devices: int = 1) -> float:
    """ms: the longer of the tower's FLOPs and its weights read once, plus the step
    overhead; 0 for no tiles."""
    if tiles == 0:
        return 0.0
    flops, nbytes = model.vision_flops_per_tile() * tiles, model.vision_params * device.dtype_bytes
    compute_ms = flops / (devices * device.peak_tflops * 1e12 * device.compute_eff) * 1e3
    memory_ms = nbytes / (devices * device.mem_bw_gbs * 1e9 * device.bw_eff) * 1e3
    return max(compute_ms, memory_ms) + device.step_overhead_ms


class NoStepModel(ValueError):
    """No step model of a tensor-parallel worker (a CPU calibration made before those were
    timed); other deployments may still be simulated."""


@dataclass
class Platform:
    """One kind of hardware running one model. ``step``/``tp_step`` (None: ``step``) give a
    worker's step model, ValueError for a size without one; ``kv_import_gbs`` in GB/s (None: free);
    slowdowns and ``time_scale`` are dimensionless factors on served steps (docs/planner.md,
    "Serving slowdown"); ``kv_capacity_tokens`` None: unbounded."""

    name: str
    step: Callable[[int], StepModel]
    worker_sizes: tuple[int, ...]
    kv_bytes_per_token: int
    kv_link: Link
    price_per_device_hour: float
    kv_import_gbs: float | None = None
    images: ImageCost | None = None
    router_ms: float = 1.0
    decode_slowdown: float = 1.0
    contended_slowdown: float = 1.0
    prefill_slowdown: dict[int, float] = field(default_factory=dict)
    time_scale: float = 1.0
    step_uncertainty: float = 0.0
    template_tokens: int = 0
    template_prefix_tokens: int = 0
    error: list[dict] | None = None
    kv_capacity_tokens: Callable[[int], int] | None = None
    tp_step: Callable[[int], StepModel] | None = None

    def worker_step(self, devices: int, tp: int = 1) -> StepModel:
        """Raises NoStepModel (no TP model of ``tp`` ranks) or ValueError (none of
        ``devices``)."""
        if tp > 1 and self.tp_step is not None:
            return self.tp_step(tp)
        return self.step(devices)

    def served_step_ms(self, step: StepModel, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                       decode_max_context: int = 0, contended: bool = False, devices: int | None = 1,
                       overlapped: bool = False) -> float:
        """ms: the decodes by ``step`` × ``decode_slowdown`` (× ``contended_slowdown`` when
        ``contended``), the rest × ``prefill_slowdown`` of ``devices`` (None: 1), all × ``time_scale``;
        ``overlapped`` (cores partly shared by round-robin ranks) slows both by ``contended_slowdown``."""
        ms = step.step_ms(prefill, num_decode, decode_context, decode_max_context)
        decodes = step.step_ms([], num_decode, decode_context, decode_max_context) if num_decode else 0.0
        slowdown = self.decode_slowdown * (self.contended_slowdown if contended or overlapped else 1.0)
        prefill_slowdown = self.prefill_slowdown.get(devices, 1.0) * (self.contended_slowdown if overlapped else 1.0)
        return (prefill_slowdown * (ms - decodes) + slowdown * decodes) * self.time_scale

    def band(self) -> list["Platform"]:
        """The platform at ``1 ± step_uncertainty`` times the step time; [] while unknown."""
        u = self.step_uncertainty
        return [replace(self, time_scale=self.time_scale * f) for f in (1 - u, 1 + u)] if u else []


# vLLM's default gpu_memory_utilization.
GPU_MEMORY_UTILIZATION = 0.9


def roofline_platform(model: ModelSpec, device: Device) -> Platform:
    """Workers of 1, 2, 4 or 8 GPUs in one node; a worker's KV holds what
    :data:`GPU_MEMORY_UTILIZATION` of its memory leaves beside the weights, as vLLM sizes its pool
    (activations not reserved; 0 where the weights do not fit)."""
    kv_bytes = model.kv_bytes_per_token(device.dtype_bytes)
    weights = model.weight_bytes(device.dtype_bytes)

    def kv_capacity_tokens(devices: int) -> int:
        return max(0, int(devices * device.memory_gb * 1e9 * GPU_MEMORY_UTILIZATION - weights) // kv_bytes)

    images = None
    if model.vision is not None:
        images = ImageCost(model.processor, lambda tiles, n: roofline_encode_ms(model, device, tiles, n),
                           model.hidden_size, device.dtype_bytes)
    return Platform(
        name=f"{model.name} on {device.name}",
        step=lambda n: Roofline(model, device, n),
        worker_sizes=(1, 2, 4, 8),
        kv_bytes_per_token=kv_bytes,
        kv_link=Link(device.link_gbs, device.link_latency_ms),
        price_per_device_hour=device.price_per_hour,
        images=images,
        kv_capacity_tokens=kv_capacity_tokens,
    )
