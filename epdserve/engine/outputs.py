"""What one engine step gives back for each request it advanced (:class:`StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.prompt_logprobs import PromptLogprob
from epdserve.engine.sampler import TokenLogprobs
from epdserve.trace import StageTimings


@dataclass
class StepOutput:
    """``finish_reason``: "stop" (EOS, stop token, grammar end), "length", "abort" or "error" (``error`` says
    why). ``kv_block_ids``: with ``hold_kv``, the prompt's blocks, held until :meth:`LLMEngine.release_kv`.
    ``timings``: ms, on the last output. ``num_cached_tokens``: prefix-cache hits at first admission (OpenAI's
    ``cached_tokens``). ``prompt_logprobs``: on the first token's output, one per prompt token but the first."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    kv_block_ids: list[int] | None = None
    timings: StageTimings = field(default_factory=StageTimings)
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
