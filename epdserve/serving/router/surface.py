"""vLLM's HTTP surface beyond the completions: ``/tokenize``, ``/detokenize``, ``/version``,
the ``--api-key`` check and ``--generation-config`` defaults (docs/serving.md, vLLM's flags
and endpoints). The API key is the clients'; workers' frames are sealed by another secret.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import json
import logging
import os
from typing import Any

import pydantic
from fastapi import FastAPI
from pydantic import Field

from epdserve import __version__
from epdserve.model.loader import ModelLoadError
from epdserve.serving.api import openai as api
from epdserve.serving.api.errors import APIError, error_body

log = logging.getLogger("epdserve.router")

MAX_TOKENIZE_CHARS = 1 << 20  # about 0.5 s of tokenizing, on a thread
MAX_DETOKENIZE_TOKENS = 1 << 17
TOKENIZE_THREADS = 2
MAX_TOKENIZE_QUEUE = 64
API_KEY_ENV = ("EPDSERVE_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key is not given
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/roles", "/workers")
UNSUPPORTED_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


def api_keys(given: list[str] | None) -> tuple[str, ...]:
    """``--api-key``'s, else the first of :data:`API_KEY_ENV` set and non-empty, else none (no check)."""
    if given:
        return tuple(given)
    return next(((os.environ[name],) for name in API_KEY_ENV if os.environ.get(name)), ())


def _digest(text: bytes) -> bytes:
    return hashlib.sha256(text).digest()


class APIKeyGuard:
    """ASGI: 401 (OpenAI's body, ``WWW-Authenticate: Bearer``, RFC 6750) under :data:`PROTECTED_PREFIXES`."""

    def __init__(self, app, keys: tuple[str, ...]):
        self.app = app
        self.digests = [_digest(k.encode()) for k in keys]

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Every key is compared, in constant time (SHA-256 digests)."""
        value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        presented = _digest(token.strip())
        matches = [hmac.compare_digest(presented, d) for d in self.digests]
        return scheme.lower() == b"bearer" and any(matches)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or not (path == "/v1" or path.startswith(PROTECTED_PREFIXES))
                or self.authorized(scope["headers"])):
            return await self.app(scope, receive, send)
        body = json.dumps(error_body("Incorrect API key provided: pass it as 'Authorization: Bearer KEY'.",
                                         code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def checked_defaults(defaults: dict, spec: str) -> dict:
    """As a request would carry them; keys no request has are dropped with a warning.
    Raises ModelLoadError naming a value a request could not carry (e.g. temperature 5)."""
    fields = set(api.ChatCompletionRequest.model_fields) | set(api.CompletionRequest.model_fields)
    kept = {}
    for key, value in defaults.items():
        if key not in fields:
            log.warning("--generation-config %s: %s=%r is not applied: requests here have no %s", spec, key,
                        value, key)
            continue
        try:  # the value as a request would carry it (top_k 0 is -1, "disabled")
            kept[key] = getattr(api.CompletionRequest(prompt="x", **{key: value}), key)
        except pydantic.ValidationError as exc:
            raise ModelLoadError(f"--generation-config {spec}: {key}={value!r}: "
                                 f"{exc.errors()[0]['msg']}") from None
    return kept


class TokenizeRequest(api._Req):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest``
    (``messages``): exactly one of them. ``add_special_tokens`` None: the form's default
    (prompt: true, chat: false, as vLLM's)."""

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TOKENIZE_CHARS)
    messages: list[api.ChatMessage] | None = Field(None, min_length=1, max_length=api.MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool = False
    chat_template: Any = None
    chat_template_kwargs: Any = None
    tools: Any = None
    mm_processor_kwargs: Any = None

    def check(self) -> None:
        """Raises APIError 400 naming the field: neither or both forms, a chat field with a prompt,
        an unsupported field, images, too much text, a lone surrogate."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give either prompt or messages", param="prompt")
        chat_only = ("add_generation_prompt", "continue_final_message", *UNSUPPORTED_CHAT_FIELDS)
        if self.prompt is not None and (given := [f for f in chat_only if getattr(self, f) is not None]):
            raise APIError(f"{given[0]} goes with messages, not prompt", param=given[0])
        if unsupported := [f for f in UNSUPPORTED_CHAT_FIELDS if getattr(self, f) is not None]:
            raise APIError(f"{unsupported[0]} is not supported by /tokenize here", param=unsupported[0])
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message")
        if self.messages is not None and any(m.num_images for m in self.messages):
            raise APIError("image parts are not supported by /tokenize here", param="messages")
        if (chars := sum(m.text_chars for m in self.messages or [])) > MAX_TOKENIZE_CHARS:
            raise APIError(f"the messages have over {MAX_TOKENIZE_CHARS} characters ({chars})", param="messages")
        where = api._invalid_unicode(self.model_dump(exclude_defaults=True), "request")
        if where is not None:
            where = where.removeprefix("request.")
            raise APIError(f"{where}: text is not valid Unicode (a lone surrogate)",
                               param=where.split(".")[0].split("[")[0])


class DetokenizeRequest(api._Req):
    """vLLM's ``DetokenizeRequest``."""

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


def tokenize(tokenizer, body: TokenizeRequest) -> list[int]:
    """Raises ValueError: the chat template cannot render the messages."""
    if body.prompt is not None:
        return tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False).input_ids
    messages = [m.as_template_dict() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=body.add_generation_prompt is not False
                                             and not body.continue_final_message,
                                             continue_final_message=bool(body.continue_final_message))
    except Exception as exc:  # jinja2 raises TemplateError and friends
        raise ValueError(f"chat template failed: {exc}") from None
    return tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids


class Tokenizing:
    """Off the event loop that streams tokens; at most :data:`MAX_TOKENIZE_QUEUE` calls wait."""

    def __init__(self):
        self.pool = concurrent.futures.ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="epdserve-tokenize")
        self.queued = 0

    async def run(self, fn, *args):
        """Raises APIError 503 when too many wait."""
        if self.queued >= MAX_TOKENIZE_QUEUE:
            raise APIError(f"the server is busy tokenizing {self.queued} requests; retry later",
                               status=503, type="service_unavailable")
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.queued -= 1


def install(app: FastAPI, router) -> None:
    front, work = router.front, Tokenizing()
    if router.api_keys:
        app.add_middleware(APIKeyGuard, keys=router.api_keys)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        front.check_model(body.model)
        body.check()
        try:
            ids = await work.run(tokenize, front.tokenizer, body)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        strs = await work.run(front.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": front.model.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        front.check_model(body.model)
        front.check_token_ids(body.tokens, "tokens")
        return {"prompt": await work.run(front.tokenizer.decode, body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}
