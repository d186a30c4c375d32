"""PD in one process (prefill and decode engines joined by the real KV hand-off, no router or workers),
for benchmarks and tests."""

from __future__ import annotations

import time

from epdserve.engine.engine import LLMEngine
from epdserve.engine.outputs import StepOutput
from epdserve.engine.request import SamplingParams
from epdserve.transfer.handoff import Exporter, Importer
from epdserve.transfer.wire import WireError
from epdserve.trace import StageTimings


def first_output(engine: LLMEngine, request_id: str) -> StepOutput:
    """Step ``engine`` until it outputs for ``request_id``; returns that output."""
    while True:
        for out in engine.step():
            if out.request_id == request_id:
                return out


def generate_pd(prefill: LLMEngine, decode: LLMEngine, exporter: Exporter, importer: Importer,
                request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> tuple[list[int], StageTimings]:
    """``prefill`` and ``decode`` must be idle. Returns the tokens and both sides' merged timings. Raises
    ValueError, WireError (as ``add_request``/``take``, or KV void at import)."""
    prefill.add_request(request_id, prompt_ids, sampling, hold_kv=True, layer_sink=exporter.layer_sink)
    out = first_output(prefill, request_id)
    tokens = list(out.token_ids)
    if out.finished:
        return tokens, out.timings
    desc = exporter.export(out)
    merged = out.timings.model_copy()
    try:
        arrival = time.perf_counter()  # as a worker stamps it: before the fetch, which queue_ms excludes
        kv, timings = importer.take(request_id, desc, decode.kv_layout(), decode.kv_cache.dtype)
        decode.add_request(request_id, prompt_ids, sampling, kv, tokens[-1], timings=timings, arrival=arrival)
        del kv  # the engine holds it until the import; then the mapping can go
        while decode.has_unfinished():
            for step_out in decode.step():
                # As the router: release after the first decode output, or on any failure (finally).
                exporter.release(request_id)
                if step_out.error is not None:
                    raise WireError(step_out.error)
                tokens += step_out.token_ids
                merged.update(step_out.timings)
    finally:
        exporter.release(request_id)
    return tokens, merged
