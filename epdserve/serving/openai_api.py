"""The OpenAI HTTP API as epdserve speaks it: request models, response builders, errors.

Only what the router serves: ``/v1/chat/completions`` (text messages) and
``/v1/completions`` (a string prompt or a list of token ids), with ``n`` choices (1 to
:data:`MAX_N`), ``logprobs`` (completions: an int; chat: ``logprobs`` + ``top_logprobs``;
at most :data:`~epdserve.engine.request.MAX_LOGPROBS`, as vLLM), OpenAI's penalties and
vLLM's extensions ``top_k``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos`` and ``include_stop_str_in_output``. Unknown request fields are accepted
and ignored, as vLLM does.

Every per-request cost has a bound, so that one request cannot hold the router: at most
:data:`MAX_STOP_STRINGS` stop strings of :data:`MAX_STOP_CHARS` characters (SGLang bounds
them too; OpenAI allows 4), :data:`MAX_MESSAGES` messages, ``n`` up to :data:`MAX_N` and
``best_of`` no more than ``n``; integers that travel to the workers fit the engine's types
(``seed`` in int64, as OpenAI and vLLM; ``top_k`` and ``stop_token_ids`` in int32). Text
must be valid Unicode: a lone surrogate (JSON ``"\\ud800"``) is a 400, not a tokenizer crash.

Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``. Every
malformed request (bad JSON, failed validation, prompt too long) is an HTTP **400** with
type ``invalid_request_error``; an unknown model is a **404** with code
``model_not_found``, as OpenAI and vLLM answer it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from epdserve.engine.request import MAX_LOGPROBS

log = logging.getLogger("epdserve.api")

MAX_N = 16  # choices per request; the router runs each as its own engine request
MAX_STOP_STRINGS = 64  # each is matched against every new piece of text of every choice
MAX_STOP_CHARS = 1024
MAX_MESSAGES = 4096
INT32_MAX = 2**31 - 1
INT64 = (-2**63, 2**63 - 1)
# JSON values (counted by their separators) in one request body. Python's json builds an
# object per value, on the event loop and holding the GIL: a 60 MB body of small ints
# (within --max-request-body-mb) stalled every stream 14 s, a 60 MB token-id prompt 90 s.
# The largest valid request (8,192 prompt ids, 1,024 stop ids, 4,096 messages of a few
# parts) has well under a tenth of this.
MAX_JSON_VALUES = 1 << 18


class APIError(Exception):
    """An error answered to the client with an OpenAI-style body.

    ``status`` is the HTTP status (400 for a request the client must fix, 500/503 for
    ours); ``param`` names the offending request field, if one does.
    """

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------- requests

class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _invalid_unicode(value, where: str) -> str | None:
    """Where in ``value`` (request JSON: str, list, dict) a string holds a lone surrogate,
    or None. Such a string cannot be encoded as UTF-8: the tokenizer and the JSON response
    would fail on it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, list):
        # Only containers and strings are looked into: no f-string per token id.
        return next((w for i, v in enumerate(value) if isinstance(v, (str, list, dict))
                     and (w := _invalid_unicode(v, f"{where}[{i}]"))), None)
    elif isinstance(value, dict):
        return next((w for k, v in value.items() if (w := _invalid_unicode(k, where) or
                                                       _invalid_unicode(v, f"{where}.{k}"))), None)
    return None


class StreamOptions(_Req):
    include_usage: bool = False


class TextPart(_Req):
    """A text content part."""

    type: Literal["text"]
    text: str


class ImagePart(_Req):
    """An image content part; ``image_url`` is checked in full by
    ``epdserve.serving.multimodal.parse_chat_images`` (400 naming the part)."""

    type: Literal["image_url"]
    image_url: dict | str


class ChatMessage(_Req):
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
        """Characters of the message's text (its string, or its text parts)."""
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content if isinstance(part, TextPart))
        return len(self.content or "")

    @property
    def num_images(self) -> int:
        return sum(isinstance(part, ImagePart) for part in self.content) if isinstance(self.content, list) else 0

    def as_template_dict(self) -> dict:
        """The message as a chat template expects it: text parts joined with newlines
        (image parts have no text: they are laid out by ``ImagePrompter``)."""
        content = self.content
        if isinstance(content, list):
            # Only text parts: the router's length check calls this on every chat request,
            # and an image part here (no .text) was an AttributeError, a 500 for any image
            # (fuzz: a text part plus an image_url part to the text model).
            content = "\n".join(part.text for part in content if isinstance(part, TextPart))
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class _SamplingFields(_Req):
    """Fields shared by chat and completions. ``max_tokens`` None = the endpoint's default."""

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
    best_of: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False

    # check_fields=False: max_completion_tokens exists on chat requests only.
    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _at_least_one(cls, v, info: ValidationInfo):
        if v is not None and v < 1:
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
        # best_of > n would sample choices that are never returned; vLLM's v1 engine dropped it.
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) other than n ({self.n}) is not supported")
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

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
        """``max_completion_tokens`` if given (OpenAI's newer name), else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token for the engine; None = no logprobs."""
        return self.logprobs

    def requested_max_tokens(self) -> int:
        """OpenAI's legacy default for completions is 16 tokens."""
        return 16 if self.max_tokens is None else self.max_tokens


# --------------------------------------------------------------------------- responses

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens served
    from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_completion(request_id: str, model: str, created: int, choices: list[dict],
                    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """A whole ``chat.completion`` object; ``choices`` from :func:`chat_choice`;
    ``completion_tokens`` summed over the choices (OpenAI)."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def _chunk(request_id: str, model: str, created: int, obj: str, content: dict,
           finish_reason: str | None, include_usage: bool, index: int, logprobs: dict | None) -> dict:
    # usage is null on every chunk when the client asked for it (OpenAI's shape); the
    # numbers come in usage_chunk at the end.
    chunk = {"id": request_id, "object": obj, "created": created, "model": model,
             "choices": [{"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, model: str, created: int, delta: dict,
               finish_reason: str | None = None, include_usage: bool = False,
               index: int = 0, logprobs: dict | None = None) -> dict:
    """One ``chat.completion.chunk`` carrying ``delta`` for choice ``index``."""
    return _chunk(request_id, model, created, "chat.completion.chunk", {"delta": delta},
                  finish_reason, include_usage, index, logprobs)


def text_completion(request_id: str, model: str, created: int, choices: list[dict],
                    prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """A whole ``text_completion`` object; ``choices`` from :func:`completion_choice`."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None = None, include_usage: bool = False,
                     index: int = 0, logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion`` chunk carrying ``text`` for choice ``index``."""
    return _chunk(request_id, model, created, "text_completion", {"text": text},
                  finish_reason, include_usage, index, logprobs)


class LogprobsFormatter:
    """OpenAI ``logprobs`` objects of one choice, built chunk after chunk from the
    engine's ``(token id, logprob, [(top id, logprob), ...])`` entries.

    ``kind`` "chat": ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
    "logprob", "bytes"}]}]}``, ``bytes`` being the token text's UTF-8 bytes. Otherwise
    OpenAI's legacy completions object: ``{"tokens", "token_logprobs", "top_logprobs":
    [{token: logprob}] (the top alternatives plus the chosen token, so up to logprobs + 1),
    "text_offset"}``, offsets (characters) counted from the choice's start across chunks,
    as vLLM does. ``token_text(id)`` gives a token's text. Logprobs are clamped at -9999.0
    (vLLM) so that the JSON never holds -inf.
    """

    def __init__(self, kind: str, token_text):
        self.kind = kind
        self.token_text = token_text
        self.offset = 0

    def __call__(self, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> dict:
        text = self.token_text
        if self.kind == "chat":
            def item(token_id: int, logprob: float) -> dict:
                t = text(token_id)
                return {"token": t, "logprob": max(logprob, -9999.0), "bytes": list(t.encode())}

            return {"content": [dict(item(t, lp), top_logprobs=[item(i, v) for i, v in top])
                                for t, lp, top in entries]}
        tokens = [text(t) for t, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [max(lp, -9999.0) for _, lp, _ in entries],
                "top_logprobs": [{**{text(i): max(v, -9999.0) for i, v in top}, tok: max(lp, -9999.0)}
                                 for tok, (_, lp, top) in zip(tokens, entries)],
                "text_offset": offsets}


def usage_chunk(request_id: str, model: str, created: int, obj: str,
                prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())


# ------------------------------------------------------------------------------ errors

class BoundedJSONRoute(APIRoute):
    """A route that refuses, with 413 before parsing it, a body with more than
    :data:`MAX_JSON_VALUES` JSON values: every value but one follows a ``,`` or a ``:``,
    and counting those bytes takes milliseconds where parsing them took seconds. (Commas
    inside strings count too; a text too long to be refused by that is refused by its
    length anyway.)"""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def bounded(request: Request):
            body = await request.body()  # cached on the request: the handler reads it again
            values = body.count(b",") + body.count(b":")
            if values > MAX_JSON_VALUES:
                raise APIError(f"request body has about {values} JSON values, over the limit of "
                               f"{MAX_JSON_VALUES}", status=413, code=413)
            return await handler(request)

        return bounded


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A short, readable message for a pydantic/FastAPI validation error, and its param."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    param = loc[0] if loc else None
    where = ".".join(loc) or "request body"
    text = f"{where}: {msg}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI, on_bad_request=None) -> None:
    """Make every error an OpenAI-style JSON body: validation errors and invalid JSON → 400
    (not FastAPI's 422), :class:`APIError` → its status, HTTP errors (404 route, 405) →
    their status, anything else → 500. ``on_bad_request()`` is called for each 400."""

    def bad(status: int) -> None:
        if status == 400 and on_bad_request is not None:
            on_bad_request()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        bad(400)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        bad(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        bad(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), type=kind, code=exc.status_code),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # The exception's text stays in the log: it can name internals (paths, peers).
        ref = uuid.uuid4().hex[:12]
        log.error("internal error %s on %s %s", ref, request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal server error (reference {ref} in the server log)",
                                       type="internal_server_error", code=500), status_code=500)
