"""Per-stage cost model: engine step time, KV and embedding bytes, transfer time.

One engine step runs prefill chunks, each ``(new_tokens, cached context)``, and
``num_decode`` decodes (one new token each) whose cached contexts sum to
``decode_context`` tokens, the longest being ``decode_max_context``. The decodes enter only
through those aggregates, so a simulated step costs O(prefill chunks), not O(batch). Two sources of step time share that interface:

* :class:`Roofline` — from a :class:`~epdserve.plan.hardware.Device` profile: the step
  takes the longer of its FLOPs at ``peak × compute_eff`` and its bytes (weights once
  per step, the KV it reads and writes) at ``bandwidth × bw_eff``, plus the tensor-parallel
  all-reduces and a fixed step overhead (the roofline model; Williams et al., CACM 2009).
* :class:`LinearStep` — fitted to steps measured on this machine (``epdserve plan
  calibrate``): ``ms = c0 + c1·sequences + c2·new tokens + c3·attention keys +
  c4·decodes × longest decode context`` (epdserve's decode attention gathers every
  sequence's blocks padded to the longest, model/llama.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from epdserve.plan.hardware import Device
from epdserve.plan.model_spec import ModelSpec

Prefill = Sequence[tuple[int, int]]  # (new tokens, cached context) per prefill chunk


class StepModel(Protocol):
    def step_ms(self, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                decode_max_context: int = 0) -> float:
        """Time in ms of one engine step."""


def attention_keys(prefill: Prefill, num_decode: int, decode_context: int) -> float:
    """Σ over the step's new tokens of the keys each attends to (causal): n·c + n(n+1)/2
    per prefill chunk, c + 1 per decode."""
    return float(sum(n * c + n * (n + 1) / 2 for n, c in prefill) + decode_context + num_decode)


@dataclass(frozen=True)
class Roofline:
    """Roofline step time of ``model`` on ``tp`` × ``device`` (tensor parallel)."""

    model: ModelSpec
    device: Device
    tp: int = 1

    def step_ms(self, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                decode_max_context: int = 0) -> float:
        m, d = self.model, self.device
        tokens = sum(n for n, _ in prefill) + num_decode
        keys = attention_keys(prefill, num_decode, decode_context)
        flops = (2.0 * m.layer_params * tokens + 2.0 * m.lm_head_params * (len(prefill) + num_decode)
                 + 4.0 * m.num_layers * m.num_heads * m.head_dim * keys)
        kv_tokens = tokens + sum(c for _, c in prefill) + decode_context  # read cached, write new
        nbytes = (m.layer_params + m.lm_head_params) * d.dtype_bytes \
            + m.kv_bytes_per_token(d.dtype_bytes) * kv_tokens
        compute_ms = flops / (self.tp * d.peak_tflops * 1e12 * d.compute_eff) * 1e3
        memory_ms = nbytes / (self.tp * d.mem_bw_gbs * 1e9 * d.bw_eff) * 1e3
        return max(compute_ms, memory_ms) + self._allreduce_ms(tokens) + d.step_overhead_ms

    def _allreduce_ms(self, tokens: int) -> float:
        # Megatron tensor parallelism: two all-reduces of the activations per layer; a
        # ring all-reduce moves 2(tp-1)/tp of the data over each link.
        if self.tp == 1:
            return 0.0
        d = self.device
        size = tokens * self.model.hidden_size * d.dtype_bytes
        one = 2 * (self.tp - 1) / self.tp * size / (d.link_gbs * 1e9) * 1e3 + d.link_latency_ms
        return 2 * self.model.num_layers * one


FEATURES = ("constant", "sequences", "new_tokens", "attention_keys", "decode_padded_keys")


def features(prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
             decode_max_context: int = 0) -> list[float]:
    """The :class:`LinearStep` regressors of one step, in :data:`FEATURES` order."""
    return [1.0, float(len(prefill) + num_decode), float(sum(n for n, _ in prefill) + num_decode),
            attention_keys(prefill, num_decode, decode_context), float(num_decode * decode_max_context)]


@dataclass(frozen=True)
class LinearStep:
    """``ms = Σ coef[i] · features[i]`` (see :data:`FEATURES`); coefficients ≥ 0."""

    coef: tuple[float, ...]

    def step_ms(self, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                decode_max_context: int = 0) -> float:
        return float(np.dot(self.coef, features(prefill, num_decode, decode_context, decode_max_context)))

    @classmethod
    def fit(cls, steps: list[tuple], ms: list[float]) -> "LinearStep":
        """Least squares on measured ``steps`` (``(prefill, num_decode, decode_context,
        decode_max_context)``,
        as :meth:`step_ms` takes them) and their times ``ms``, relative error weighted (each step counts
        by its share, so the 75 ms decodes matter as much as 5 s prefills); features whose
        coefficient comes out negative are dropped and the rest refitted.

        Raises:
            ValueError: fewer measured steps than features.
        """
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
    """A transfer path: ``gbs`` GB/s (10^9 bytes/s) and a fixed ``latency_ms``."""

    gbs: float
    latency_ms: float

    def transfer_ms(self, nbytes: float) -> float:
        """bytes / bandwidth + latency, in ms."""
        return nbytes / (self.gbs * 1e9) * 1e3 + self.latency_ms


@dataclass
class Platform:
    """Everything the simulator needs about one kind of hardware running one model.

    ``step(devices)``: the step model of a worker on that many devices (cores or GPUs);
    ``worker_sizes``: devices a worker may have; ``kv_bytes_per_token`` of the KV on the
    wire; ``kv_link``: prefill → decode path; ``kv_import_gbs``: the decode worker's copy
    of arriving KV into its cache (blocks its step; None = free); ``encode_ms_per_image``
    and ``embedding_bytes_per_image`` (0 for text models); ``router_ms``: client ↔ router
    overhead added to every token; ``template_tokens``: tokens a chat template adds to a
    prompt; ``error``: prediction errors measured at the last validation (None if never).
    """

    name: str
    step: Callable[[int], StepModel]
    worker_sizes: tuple[int, ...]
    kv_bytes_per_token: int
    kv_link: Link
    price_per_device_hour: float
    kv_import_gbs: float | None = None
    encode_ms_per_image: float = 0.0
    embedding_bytes_per_image: int = 0
    router_ms: float = 1.0
    template_tokens: int = 0
    error: dict | None = None


def roofline_platform(model: ModelSpec, device: Device) -> Platform:
    """A :class:`Platform` for ``model`` on ``device`` GPUs (workers of 1, 2, 4 or 8 in
    one node; KV over NVLink/PCIe within the node). Encode time per image is the vision
    tower's roofline compute (2 FLOPs per parameter per image token)."""
    encode_flops = 2.0 * model.vision_params * model.image_tokens
    return Platform(
        name=f"{model.name} on {device.name}",
        step=lambda n: Roofline(model, device, n),
        worker_sizes=(1, 2, 4, 8),
        kv_bytes_per_token=model.kv_bytes_per_token(device.dtype_bytes),
        kv_link=Link(device.link_gbs, device.link_latency_ms),
        price_per_device_hour=device.price_per_hour,
        encode_ms_per_image=encode_flops / (device.peak_tflops * 1e12 * device.compute_eff) * 1e3,
        embedding_bytes_per_image=model.embedding_bytes_per_image(device.dtype_bytes),
    )
