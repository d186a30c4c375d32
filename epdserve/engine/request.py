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
# vLLM's _MAX_TEMP: a temperature in (0, 1e-2) is raised to it (a tinier one overflows); 0 stays greedy.
MIN_TEMPERATURE = 1e-2
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
# Every step checks each new token against the list, and it rides every wire message: keep it bounded.
MAX_STOP_TOKEN_IDS = 1024
# No vocabulary or context nears 2^31 (this bounds top_k, max_tokens and min_tokens too).
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# Guided spec characters: it rides to and compiles on every worker; real schemas are a few KB.
MAX_GUIDED_CHARS = 1 << 16
# OpenAI's logit_bias: at most 300 tokens, each biased by -100 .. 100.
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0


class GuidedSpec(BaseModel):
    """``value``: a JSON schema's text ("json"), "" ("json_object"), a regex, a JSON list of strings
    ("choice") or a GBNF grammar. Raises pydantic.ValidationError for another kind or a longer value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar"]
    value: str = Field("", max_length=MAX_GUIDED_CHARS)


class SamplingParams(BaseModel):
    """OpenAI's and vLLM's meanings (order applied: ``engine.sampler``); ``top_k`` -1, ``min_p`` 0 and
    ``repetition_penalty`` 1 are off. Also the router → worker wire type: ``logit_bias`` keys travel as strings
    (msgpack). Raises pydantic.ValidationError out of the Field bounds or for ``min_tokens`` > ``max_tokens``."""

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
    """``positions [R]`` (long): prompt positions of the ``<image>`` tokens; ``spans``: per image
    ``(first, last + 1, content hash)`` (tile markers may sit inside); ``embeddings [R, hidden]``, None on a
    decode worker that imports the KV. Raises ValueError when tokens or embeddings do not fit the images."""

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
        """Block ``block``'s extra prefix-cache keys (vLLM's mm hashes): images with a token in it."""
        lo, hi = block * block_size, (block + 1) * block_size
        return tuple(h for first, end, h in self.spans if first < hi and end > lo)

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(offsets [r] from start, embeddings [r, hidden])`` of the image tokens in ``start .. start + n - 1``."""
        lo, hi = torch.searchsorted(self.positions, torch.tensor([start, start + n])).tolist()
        return self.positions[lo:hi] - start, self.embeddings[lo:hi]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """``token_ids``: prompt + generated; the first ``num_computed_tokens`` have K/V in ``block_table``.
    ``guided``: the grammar matcher after the output tokens (it survives a preemption, as the tokens do).
    ``resume_ids``: output another worker made before it died; computed again with the prompt, as after a
    preemption, and counted as output (max_tokens, min_tokens, penalties, the seeded draws)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 pending_kv: KVSource | None = None, first_token: int | None = None,
                 images: PromptImages | None = None, resume_ids: list[int] = ()):
        self.request_id = request_id
        self.images = images
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.block_table: list[int] = []
        # Prefix cache: full-block keys, cached leading blocks, tokens found cached at first admission.
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens: int | None = None
        self.num_computed_tokens = 0
        self.status = Status.WAITING
        self.pending_kv = pending_kv
        self.hold_kv = False
        self.layer_sink: LayerSink | None = None
        self.guided: xgrammar.GrammarMatcher | None = None
        outputs = ([] if first_token is None else [first_token]) + list(resume_ids)
        self.token_ids += outputs
        self.num_output_tokens = len(outputs)
        self.arrival = time.perf_counter()
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        # Tokens that ever had K/V here: what a preemption recomputes below it counts in num_recomputed_tokens.
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
