"""Which flow serves a request: by the mode, or (elastic, ``serve --elastic``) by the roles
live when it arrives."""

from __future__ import annotations

from epdserve.serving import protocol as P
from epdserve.serving.router.epd_flow import EncodeFlow
from epdserve.serving.router.flows import DisaggregatedFlow, Flow, FlowConfig, LocalPrefillFlow, SingleWorkerFlow
from epdserve.serving.router.registry import Registry


def new_flow(registry: Registry, config: FlowConfig, request_id: str, prompt_ids: list[int],
             sampling: P.SamplingParams, t_arrival: float, images: list[P.ImageRef] = ()) -> Flow:
    """``images``: with their bytes; ``t_arrival``: on ``config.clock``."""
    path = registry.serving_path() if config.elastic else config.mode
    cls = flow_class(path, config, len(prompt_ids), bool(images))
    return cls(registry, config, request_id, prompt_ids, sampling, t_arrival, images)


def flow_class(path: str | None, config: FlowConfig, prompt_tokens: int, has_images: bool) -> type[Flow]:
    """``path``: the mode, or :meth:`Registry.serving_path` (elastic; None: no way, a 503)."""
    if path == "colocated":
        return SingleWorkerFlow
    if path == "local" or prompt_tokens < config.local_prefill_threshold and not has_images:
        return LocalPrefillFlow
    if config.mode == "epd" and has_images:
        return EncodeFlow
    return DisaggregatedFlow
