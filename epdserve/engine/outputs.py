"""What one engine step gives back for each request it advanced (:class:`StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.prompt_logprobs import PromptLogprob
from epdserve.engine.sampler import TokenLogprobs
from epdserve.trace import StageTimings


@dataclass
class StepOutput:
    """One request's result of a step.

    ``token_ids``: tokens generated this step (one, or none for an abort).
    ``finished``/``finish_reason``: "stop" (EOS, a stop token, or the end of a guided
    request's grammar), "length" (max_tokens or the context window), "abort", "error"
    (then ``error`` says why: the request's imported KV was void, or its next token could
    not be sampled; other requests go on).
    ``kv_block_ids``: for a request that asked to ``hold_kv`` (finished False), the handle of
    the hold: the blocks holding the prompt's KV; they stay allocated until
    :meth:`LLMEngine.release_kv`. ``timings``: ms, on the request's last output.
    ``num_cached_tokens``: prompt tokens found in the prefix cache when the request was
    first admitted (OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
    ``logprobs``: one :data:`~epdserve.engine.sampler.TokenLogprobs` per token of
    ``token_ids`` if the request asked for logprobs, else None.
    ``prompt_logprobs``: on the first token's output of a request that asked for them
    (``SamplingParams.prompt_logprobs``) and prefilled its prompt here, one
    :data:`~epdserve.engine.prompt_logprobs.PromptLogprob` per prompt token but the first.
    """

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
