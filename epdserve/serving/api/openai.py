"""The chat and completions requests as epdserve takes them (docs/serving.md, Request fields):
every per-request cost bounded, integers sized for the engine's types, text valid Unicode."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from epdserve.engine.request import MAX_LOGPROBS
from epdserve.serving.api.errors import field_error
from epdserve.serving.api.structured_output import GuidedFields
from epdserve.serving.api.tool_calls import ToolMessageFields, ToolRequestFields

MAX_N = 16
MAX_STOP_STRINGS = 64  # each is matched against every new piece of text of every choice
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 4096
# vLLM has no bound, but every prompt holds router state and worker queue slots
MAX_PROMPTS = 256
MAX_SEQUENCES = 1024  # engine requests of one HTTP request: prompts x best_of
MAX_TEMPLATE_KWARGS_CHARS = 16384  # chat_template_kwargs, as JSON
INT32_MAX = 2**31 - 1
INT64 = (-2**63, 2**63 - 1)
class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Request(_Req):
    # extra fields are kept for fields.check: never dropped unseen
    model_config = ConfigDict(extra="allow")


def _invalid_unicode(value, where: str) -> str | None:
    """Where a string holds a lone surrogate (no UTF-8: the tokenizer and response would fail), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, list):
        # no f-string per token id
        return next((w for i, v in enumerate(value) if isinstance(v, (str, list, dict))
                     and (w := _invalid_unicode(v, f"{where}[{i}]"))), None)
    elif isinstance(value, dict):
        return next((w for k, v in value.items() if (w := _invalid_unicode(k, where) or
                                                       _invalid_unicode(v, f"{where}.{k}"))), None)
    return None


class StreamOptions(_Req):
    """``continuous_usage_stats`` (vLLM; with ``include_usage``): every chunk carries the
    usage so far of its choice."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Req):
    """A text content part."""

    type: Literal["text"]
    text: str


class ImagePart(_Req):
    """An image content part; ``image_url`` is checked in full by
    ``epdserve.serving.api.multimodal.parse_chat_images`` (400 naming the part)."""

    type: Literal["image_url"]
    image_url: dict | str


class ChatMessage(ToolMessageFields, _Req):
    role: str
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind not in ("text", "image_url"):
                    raise ValueError(f"unsupported content part type {kind!r} (supported: text, image_url)")
        return v

    @property
    def text_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content if isinstance(part, TextPart))
        return len(self.content or "")

    @property
    def num_images(self) -> int:
        return sum(isinstance(part, ImagePart) for part in self.content) if isinstance(self.content, list) else 0

    def as_template_dict(self) -> dict:
        """Text parts joined with newlines; images are laid out by ``ImagePrompter``."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content if isinstance(part, TextPart))
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out | self.tool_template_fields()


class _SamplingFields(GuidedFields, _Request):
    """Chat's and completions' fields. ``max_tokens`` None: the endpoint's default; ``echo``
    (chat, vLLM): the last message's text before the answer when it is the assistant's."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field([], max_length=1024)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    return_tokens_as_token_ids: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False

    # check_fields=False: max_completion_tokens exists on chat requests only.
    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _at_least_one(cls, v, info: ValidationInfo):
        if v is not None and v < 0:  # 0: completions with echo only (see _checks)
            raise ValueError(f"{info.field_name} must be at least 1, got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if v == 0:
            return -1
        if v < -1:
            raise ValueError(f"top_k must be -1 (disabled) or at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
        return v

    @model_validator(mode="after")
    def _checks(self):
        if self.best_of is not None and self.best_of < self.n:
            raise field_error("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.candidates > self.n and self.stream:  # OpenAI: "Results cannot be streamed."
            raise field_error("best_of", "best_of greater than n cannot be streamed")
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule
            raise field_error("prompt_logprobs", "prompt_logprobs are not available with stream")
        if self.max_tokens == 0 and not (self.echo and isinstance(self, CompletionRequest)):
            raise field_error("max_tokens", "max_tokens must be at least 1 (0 only with echo, on completions)")
        if getattr(self, "max_completion_tokens", None) == 0:
            raise field_error("max_completion_tokens", "max_completion_tokens must be at least 1")
        where = _invalid_unicode(self.model_dump(exclude_defaults=True), "request")
        if where is not None:
            raise ValueError(f"{where.removeprefix('request.')}: text is not valid Unicode (a lone surrogate)")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def candidates(self) -> int:
        return self.best_of or self.n

    @property
    def engine_logprobs(self) -> int | None:
        """0 when the client asked none but ``best_of`` must rank choices by their logprobs."""
        return 0 if self.num_logprobs is None and self.candidates > self.n else self.num_logprobs


class ChatCompletionRequest(ToolRequestFields, _SamplingFields):
    """vLLM's chat extras: ``add_generation_prompt``, ``continue_final_message`` (not both),
    ``add_special_tokens`` (on top of the template's; default off) and
    ``chat_template_kwargs`` (variables for the chat template, at most
    :data:`MAX_TEMPLATE_KWARGS_CHARS` as JSON; a name the renderer itself uses is refused
    by the router)."""

    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded_kwargs(cls, v):
        if v is not None and len(json.dumps(v)) > MAX_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON")
        return v

    @model_validator(mode="after")
    def _one_prompt_end(self):
        if self.continue_final_message and self.add_generation_prompt:  # vLLM's rule
            raise field_error("continue_final_message",
                              "continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def prompt_logprobs_k(self) -> int | None:
        return self.prompt_logprobs

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine; None = no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("messages must contain at least one message")
        return v


    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    """``prompt``: a string, token ids, or a batch (OpenAI) of 1 to :data:`MAX_PROMPTS` of
    either, whose choices are indexed ``prompt index * n + choice index``; prompts x
    ``best_of`` at most :data:`MAX_SEQUENCES`. ``add_special_tokens`` (vLLM, default on):
    the tokenizer's BOS etc. around a string prompt."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _bounded_batch(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in a batch, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _bounded_sequences(self):
        if len(self.prompts) * self.candidates > MAX_SEQUENCES:
            raise field_error("prompt", f"{len(self.prompts)} prompts x {self.candidates} choices is over the "
                                        f"limit of {MAX_SEQUENCES} sequences per request")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine; None = no logprobs."""
        return self.logprobs

    @property
    def prompt_logprobs_k(self) -> int | None:
        """``prompt_logprobs``, else ``logprobs`` with ``echo`` (vLLM); None: none."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def requested_max_tokens(self) -> int:
        """OpenAI's legacy default: 16 tokens."""
        return 16 if self.max_tokens is None else self.max_tokens

