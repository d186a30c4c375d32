"""Per-stage cost model: engine step time, image encoding, KV and embedding bytes,
transfer time.

One engine step runs prefill chunks, each ``(new_tokens, cached context)``, and
``num_decode`` decodes (one new token each) whose cached contexts sum to
``decode_context`` tokens, the longest being ``decode_max_context``. The decodes enter only
through those aggregates, so a simulated step costs O(prefill chunks), not O(batch). Two sources of step time share that interface:

* :class:`Roofline` — from a :class:`~epdserve.plan.hardware.Device` profile: each of
  the step's weight GEMMs, prefill attention and decode attention takes the longer of its
  FLOPs at ``peak × compute_eff`` and its bytes (weights once per step, the KV it reads
  and writes) at ``bandwidth × bw_eff``; the step is their sum, plus the tensor-parallel
  all-reduces and a fixed step overhead (the roofline model; Williams et al., CACM 2009).
* :class:`LinearStep` — fitted to steps measured on this machine (``epdserve plan
  calibrate``): ``ms = c0 + c1·sequences + c2·new tokens + c3·attention keys +
  c4·decodes × longest decode context`` (epdserve's decode attention gathers every
  sequence's blocks padded to the longest, model/llama.py).

Images (:class:`ImageCost`): tiles and prompt tokens per image follow the model's image
processor (``ImageProcessor.grid`` / ``num_tokens``, Idefics3's rules); one encode call
(a batch of tiles through the vision tower) costs a roofline of the tower's FLOPs per tile
on a device profile, or the time per tile measured by calibration; embedding bytes are
image tokens × hidden × bytes per element (the frame header, well under 1 KB, is left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from epdserve.model.image_processor import ImageProcessor
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
        """Time in ms: the weight GEMMs, the prefill attention and the decode attention
        each take the longer of their FLOPs and their bytes (the kernels run one after
        another, so a mixed step's memory-bound decode attention is not hidden under its
        compute-bound prefill), plus the all-reduces and the step overhead."""
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


@dataclass(frozen=True)
class ImageCost:
    """What one image costs on a platform. ``processor``: the model's image preprocessing
    (tile grid and ``<image>`` tokens from the image size, without decoding it);
    ``encode_ms(tiles, devices)``: one encode call of that many tiles on a worker of that
    many devices, in ms (0 tiles: 0); ``hidden_size`` / ``dtype_bytes``: the embeddings'
    width and element size."""

    processor: ImageProcessor
    encode_ms: Callable[[int, int], float]
    hidden_size: int
    dtype_bytes: int

    def tiles(self, size: tuple[int, int]) -> int:
        """Tiles the vision tower runs for an image of ``size`` = (width, height) pixels:
        rows × cols + the global image (1 when not split)."""
        rows, cols = self.processor.grid(size)
        return rows * cols + 1

    def tokens(self, size: tuple[int, int]) -> int:
        """``<image>`` tokens (embedding rows) of an image of ``size``."""
        return self.processor.num_tokens(self.processor.grid(size))

    def prompt_tokens(self, size: tuple[int, int]) -> int:
        """Prompt tokens an image adds: its ``<image>`` tokens, the markup around them
        (Idefics3: ``<fake_token_around_image>`` + ``<row_r_col_c>`` per tile, a newline
        per row and one more, ``<fake_token_around_image><global-img>`` ...
        ``<fake_token_around_image>``) and the newline that joins an image part to the
        message's text (serving/api/multimodal.py). Counted as SmolVLM's BPE tokenizes them:
        one token per newline, except the last row's and the blank line's, which merge."""
        rows, cols = self.processor.grid(size)
        markup = 2 * rows * cols + rows + 3
        return self.tokens(size) + markup + 1

    def embedding_bytes(self, size: tuple[int, int]) -> int:
        """Bytes of an image's embeddings on the wire: tokens × hidden × dtype bytes."""
        return self.tokens(size) * self.hidden_size * self.dtype_bytes


def roofline_encode_ms(model: ModelSpec, device: Device, tiles: int, devices: int = 1) -> float:
    """One encode call of ``tiles`` tiles on ``devices`` × ``device``: the longer of the
    tower's FLOPs (:meth:`ModelSpec.vision_flops_per_tile`) at ``peak × compute_eff`` and
    its weights read once at ``bandwidth × bw_eff``, plus the step overhead; 0 for no tiles."""
    if tiles == 0:
        return 0.0
    flops, nbytes = model.vision_flops_per_tile() * tiles, model.vision_params * device.dtype_bytes
    compute_ms = flops / (devices * device.peak_tflops * 1e12 * device.compute_eff) * 1e3
    memory_ms = nbytes / (devices * device.mem_bw_gbs * 1e9 * device.bw_eff) * 1e3
    return max(compute_ms, memory_ms) + device.step_overhead_ms


class NoStepModel(ValueError):
    """A platform has no step model of a kind of worker (a tensor-parallel one on a CPU
    calibration made before those were timed); other deployments may still be simulated."""


@dataclass
class Platform:
    """Everything the simulator needs about one kind of hardware running one model.

    ``step(devices)``: the step model of a worker on that many devices (cores or GPUs);
    ``worker_sizes``: devices a worker may have; ``kv_bytes_per_token`` of the KV on the
    wire; ``kv_link``: prefill → decode path; ``kv_import_gbs``: the decode worker's copy
    of arriving KV into its cache (blocks its step; None = free); ``images``: what images
    cost (None: the model takes no images), their embeddings crossing ``kv_link`` too (the
    same transports carry them); ``router_ms``: client → router → worker time added once
    to every request on its way in; ``decode_slowdown``: how many times longer the decode
    work of a step takes when served than the step model says (dimensionless, > 0; 1: as
    calibrated; learned from ``compare`` runs, :func:`epdserve.plan.serving_fit.fit_serving`),
    fitted on steps while a device was free; ``contended_slowdown``: how many times longer
    still while every other device of the deployment is busy (dimensionless; 1: no such
    effect, as on GPU hosts, whose CPUs the router has to itself; on a CPU host the router
    and the client then take their time from the workers' cores);
    ``prefill_slowdown``: per worker size (devices), how many times longer the prefill
    work of a served step takes than the step model says (dimensionless; a size not in it:
    1; :func:`epdserve.plan.serving_fit.fit_prefill`), whatever the other devices do (it
    is fitted on served prefills as they came);
    ``time_scale``: a factor on every step and encode time (dimensionless; 1: as modeled),
    to ask what a machine that much slower or faster would do; ``step_uncertainty``: how far
    (relative, dimensionless) served step times are known, from the spread of the served
    runs the slowdown was fitted on (0: not known), the ± ``time_scale`` of a prediction's band;
    ``kv_capacity_tokens(devices)``: tokens of KV cache a worker on that many devices holds
    (None: unbounded); ``template_tokens``: tokens a chat template adds to a
    prompt, the first ``template_prefix_tokens`` of them the same in every prompt (its
    system turn: the engine's prefix cache keeps their full blocks); ``error``: the
    prediction errors of the last validation of each workload (as ``plan validate`` stores
    them; None if never validated); ``tp_step(ranks)``: the step model of a tensor-parallel
    worker of that many ranks (processes, one device each), where it is not ``step(ranks)``
    (None: it is, as on GPUs, whose roofline models a worker of n devices as TP=n; a
    calibrated CPU's ``step(2)`` is one process of 2 threads, its TP=2 fit another model,
    :func:`epdserve.plan.calibrate.platform_from`); it raises ``ValueError`` for a size
    it has no model of.
    """

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
        """The step model of a worker of ``devices`` devices in ``tp`` tensor-parallel ranks
        (1: one process on all of them).

        Raises:
            NoStepModel: no model of a TP worker of ``tp`` ranks (a calibration made
                before TP workers were timed).
            ValueError: no model of a one-process worker of ``devices``.
        """
        if tp > 1 and self.tp_step is not None:
            return self.tp_step(tp)
        return self.step(devices)

    def served_step_ms(self, step: StepModel, prefill: Prefill, num_decode: int = 0, decode_context: int = 0,
                       decode_max_context: int = 0, contended: bool = False, devices: int | None = 1,
                       overlapped: bool = False) -> float:
        """Time in ms of one served engine step on a worker of ``devices`` whose step model
        is ``step``: what its decodes alone would take by ``step`` × ``decode_slowdown``
        (× ``contended_slowdown`` when ``contended``: every other device of the deployment
        busy), plus the rest of its time by ``step`` (its prefill work, all of a
        prefill-only step) × ``prefill_slowdown`` of its size (``devices`` None: a worker
        none was fitted for, a tensor-parallel one: 1), all × ``time_scale``. ``overlapped``:
        a worker that partly shares its cores is busy (round-robin placement of more ranks
        than cores): the prefill work too × ``contended_slowdown``, and the decodes as
        ``contended``."""
        ms = step.step_ms(prefill, num_decode, decode_context, decode_max_context)
        decodes = step.step_ms([], num_decode, decode_context, decode_max_context) if num_decode else 0.0
        slowdown = self.decode_slowdown * (self.contended_slowdown if contended or overlapped else 1.0)
        prefill_slowdown = self.prefill_slowdown.get(devices, 1.0) * (self.contended_slowdown if overlapped else 1.0)
        return (prefill_slowdown * (ms - decodes) + slowdown * decodes) * self.time_scale

    def band(self) -> list["Platform"]:
        """This platform with every step and encode ``1 − step_uncertainty`` and
        ``1 + step_uncertainty`` times as long: what a prediction's band is simulated on
        (none while the uncertainty is not known)."""
        u = self.step_uncertainty
        return [replace(self, time_scale=self.time_scale * f) for f in (1 - u, 1 + u)] if u else []


# vLLM's default ``gpu_memory_utilization``: the share of a GPU's memory its engine takes.
GPU_MEMORY_UTILIZATION = 0.9


def roofline_platform(model: ModelSpec, device: Device) -> Platform:
    """A :class:`Platform` for ``model`` on ``device`` GPUs (workers of 1, 2, 4 or 8 in
    one node; KV and embeddings over NVLink/PCIe within the node; encoding by
    :func:`roofline_encode_ms` for a vision-language model). A worker's KV cache is what
    :data:`GPU_MEMORY_UTILIZATION` of its memory holds beyond the weights (split over its
    devices; activations not reserved), as vLLM sizes its block pool; 0 where the weights
    do not fit."""
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
