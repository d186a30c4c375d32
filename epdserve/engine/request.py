"""A request inside the engine: its sampling settings and its sequence state."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from epdserve.engine.kv_source import KVSource, LayerSink
from epdserve.trace import StageTimings

if TYPE_CHECKING:  # xgrammar is imported only by a worker that gets a guided request
    import xgrammar

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs limit
# vLLM's _MAX_TEMP (vllm/sampling_params.py, SamplingParams.__post_init__): a temperature
# in (0, 1e-2) is raised to it (vLLM also logs a warning), since dividing logits by a tinier
# one overflows to inf, and one under 1e-45 is 0 in float32. 0 itself stays greedy.
MIN_TEMPERATURE = 1e-2
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# At most this many stop_token_ids: every step checks each new token against the list and
# the min_tokens mask indexes every id, and the list rides in the request's wire message,
# so an unbounded one would slow the whole batch. Real uses need a handful.
MAX_STOP_TOKEN_IDS = 1024
# A token id (no vocabulary comes near 2^31 tokens, nor a context near 2^31 positions,
# which bounds top_k, max_tokens and min_tokens alike).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# A guided request's schema, regex, grammar or choice list, in characters. It rides in the
# request's wire message to every worker that serves it and each compiles it (the compile's
# cost follows the grammar's size); real JSON schemas, tool sets included, are a few KB.
MAX_GUIDED_CHARS = 1 << 16
# OpenAI's logit_bias: at most 300 tokens, each biased by -100 .. 100.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0


class GuidedSpec(BaseModel):
    """A structured-output constraint (see :mod:`epdserve.engine.guided`): ``kind`` "json"
    (``value``: a JSON schema's JSON text), "json_object" (any JSON object; ``value`` "",
    unused), "regex" (a regular expression), "choice" (a JSON list of strings) or "grammar"
    (an EBNF grammar in xgrammar's syntax), ``value`` at most 65,536 characters.

    Raises (validation): ``pydantic.ValidationError`` for another kind or a longer value.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    value: str = Field("", max_length=MAX_GUIDED_CHARS)


class SamplingParams(BaseModel):
    """Per-request sampling settings, with the OpenAI API's (and vLLM's) meanings.

    ``max_tokens`` counts generated tokens; ``temperature`` = 0 is greedy; ``top_k`` = -1
    disables top-k; ``seed`` makes sampling reproducible; ``ignore_eos`` keeps generating
    past EOS; ``stop_token_ids`` end the request like EOS. ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI, -2..2) act on the output tokens, ``repetition_penalty``
    (vLLM, > 0, 1 = none) on prompt and output tokens; ``min_tokens`` (vLLM) suppresses EOS
    and ``stop_token_ids`` until that many tokens are generated; ``logprobs`` (None = none)
    returns each generated token's logprob and the top ``logprobs`` alternatives, of the
    model's raw distribution (vLLM's default ``logprobs_mode`` "raw_logprobs");
    ``prompt_logprobs`` (vLLM, None = none) the same for every prompt token but the first,
    with the top ``prompt_logprobs`` alternatives (``engine/prompt_logprobs.py``).
    ``logit_bias`` (OpenAI) adds a bias in [-100, 100] to up to 300 tokens' logits;
    ``min_p`` (vLLM, 0..1, 0 = none) drops tokens whose probability is under ``min_p``
    times the most likely one's; ``guided`` constrains the output to a grammar
    (:class:`GuidedSpec`). See ``epdserve.engine.sampler`` for the order they apply in.

    Bounds (this is also the router -> worker wire type, so they hold on every path):
    floats finite; ``temperature`` >= 0, a value in (0, 1e-2) raised to 1e-2 (vLLM's
    ``_MAX_TEMP`` clamp; 0 stays greedy); ``seed`` in int64 (vLLM's and OpenAI's range,
    and what msgpack packs); ``top_k`` -1 or 1 .. 2^31-1; ``stop_token_ids`` at most 1024
    ids in [0, 2^31-1] (the engine also refuses ids outside its vocabulary);
    ``max_tokens`` and ``min_tokens`` at most 2^31-1; ``repetition_penalty`` any finite
    value > 0 (the sampler keeps the logits finite for all of them). ``logit_bias`` keys
    are token ids (the engine refuses ids outside its vocabulary); on the wire they are
    strings, as msgpack maps here take only string keys (and as OpenAI sends them).

    Raises (validation): ``pydantic.ValidationError`` for a value out of range or
    ``min_tokens`` > ``max_tokens``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_tokens: int = Field(16, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] = Field(
        {}, max_length=MAX_LOGIT_BIAS)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    guided: GuidedSpec | None = None

    @field_serializer("logit_bias")
    def _string_keys(self, v: dict[int, float]) -> dict[str, float]:
        return {str(k): b for k, b in v.items()}

    @field_validator("temperature")
    @classmethod
    def _clamp_tiny_temperature(cls, v: float) -> float:
        return MIN_TEMPERATURE if 0 < v < MIN_TEMPERATURE else v

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, v: int) -> int:
        if v == 0:  # the router maps the OpenAI-side 0 to -1 before it gets here
            raise ValueError("top_k must be -1 (disabled) or at least 1, got 0")
        return v

    @model_validator(mode="after")
    def _min_tokens_at_most_max(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})")
        return self


class PromptImages:
    """The images of one prompt, as the engine needs them.

    ``positions [R]`` (long): the prompt positions of the ``<image>`` tokens, in order;
    ``spans``: per image ``(first position, last position + 1, content hash)`` in prompt
    order (an image's tokens need not be contiguous: tile markers sit between tiles);
    ``embeddings [R, hidden]``: what replaces the token embeddings at ``positions``, or
    None on a decode worker that imports the prompt's KV (it only needs the hashes, for
    its prefix cache keys).

    Raises (constructor): ``ValueError`` when the prompt's ``<image>`` tokens do not add up
    to the images' token counts, or the embeddings have another row count or width.
    """

    def __init__(self, prompt_token_ids: list[int], image_token_id: int, images: list[tuple[str, int]],
                 embeddings: torch.Tensor | None, hidden_size: int):
        self.positions = (torch.tensor(prompt_token_ids) == image_token_id).nonzero().flatten()
        counts = [n for _, n in images]
        if len(self.positions) != sum(counts):
            raise ValueError(f"prompt has {len(self.positions)} image tokens, its {len(images)} images"
                             f" need {sum(counts)}")
        if embeddings is not None and tuple(embeddings.shape) != (len(self.positions), hidden_size):
            raise ValueError(f"image embeddings of shape {tuple(embeddings.shape)}, expected"
                             f" ({len(self.positions)}, {hidden_size})")
        self.embeddings = embeddings
        self.spans = [(int(chunk[0]), int(chunk[-1]) + 1, h)
                      for chunk, (h, _) in zip(self.positions.split(counts), images)]

    def block_keys(self, block: int, block_size: int) -> tuple[str, ...]:
        """Hashes of the images with a token in prompt block ``block``: the extra keys of
        its prefix cache key (vLLM's mm hashes), so equal tokens with other images never match."""
        lo, hi = block * block_size, (block + 1) * block_size
        return tuple(h for first, end, h in self.spans if first < hi and end > lo)

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For prompt positions ``start .. start + n - 1``: ``(offsets [r] from start,
        embeddings [r, hidden])`` of the image tokens among them."""
        lo, hi = torch.searchsorted(self.positions, torch.tensor([start, start + n])).tolist()
        return self.positions[lo:hi] - start, self.embeddings[lo:hi]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request's tokens and KV blocks.

    ``token_ids`` = prompt + generated tokens; the first ``num_computed_tokens`` of them
    have K/V in ``block_table``. A sequence whose KV is imported starts with the prompt's
    KV blocks in ``pending_kv`` (an :class:`~epdserve.engine.kv_source.KVSource`) and its
    first token already generated elsewhere. ``images``: its prompt's images, if any.
    ``hold_kv`` / ``layer_sink``: see :meth:`~epdserve.engine.engine.LLMEngine.add_request`.
    ``guided``: a guided request's grammar matcher, in the state after its output tokens
    (it survives a preemption as the tokens do: recompute rebuilds KV, not tokens).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 pending_kv: KVSource | None = None, first_token: int | None = None,
                 images: PromptImages | None = None):
        self.request_id = request_id
        self.images = images
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.block_table: list[int] = []
        # Prefix cache (engine/prefix_cache.py): keys of its full blocks, how many leading
        # blocks of block_table are cached, and the tokens found cached at first admission.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens: int | None = None
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.pending_kv = pending_kv
        self.hold_kv = False
        self.layer_sink: LayerSink | None = None
        self.guided: xgrammar.GrammarMatcher | None = None
        self.num_output_tokens = 0
        if first_token is not None:
            self.token_ids.append(first_token)
            self.num_output_tokens = 1
        self.arrival = time.perf_counter()
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        # Tokens that had K/V here at some point (computed, imported or found cached): what
        # it computes again up to this mark after a preemption is num_recomputed_tokens.
        self.max_computed_tokens = 0
        self.num_recomputed_tokens = 0
        self.timings = StageTimings()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose K/V must still be computed."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
