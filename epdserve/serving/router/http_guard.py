"""HTTP limits that keep one client from holding the router: uvicorn sets no deadline on a request that has
started (slowloris). Head deadline: :class:`GuardedHttpProtocol`; body size and deadline: :class:`RequestLimits`;
connections: uvicorn's ``limit_concurrency``, its 503 with an OpenAI error body."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from epdserve.argtypes import float_above, int_at_least, setting
from epdserve.serving.api.errors import error_body

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_BODY_MB = 64  # 8 images at the 20 MB image limit need more: raise it for those
DEFAULT_LIMIT_CONCURRENCY = 1024


class GuardedHttpProtocol(HttpToolsProtocol):
    """Closes a connection whose request head is not complete ``header_timeout_s`` seconds after it opened or
    the request's first byte (no response: the client has not finished asking)."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        self._head_timer = None
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.logger.warning("closed a connection whose request head took over %.0f s", self.header_timeout_s)
            self.transport.close()


class RequestLimits:
    """ASGI middleware: 413 to a body over ``max_body_bytes`` (by ``Content-Length`` before reading, else while
    reading), 408 to one not complete ``body_timeout_s`` seconds after the head. The app gets the body in one
    message; later reads (a stream awaiting the client's disconnect) go to the connection."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _error(send, 413, self._too_large(int(length)))
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: let the app see it
                        return await self.app(scope, _replay([message], receive), send)
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_body_bytes:
                        return await _error(send, 413, self._too_large(size))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await _error(send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                           "(--http-body-timeout)")
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    def _too_large(self, nbytes: int) -> str:
        return (f"request body of {nbytes} bytes is over the limit of {self.max_body_bytes} bytes "
                "(--max-request-body-mb)")


def _replay(messages: list[dict], receive):
    async def replay():
        return messages.pop(0) if messages else await receive()
    return replay


async def _error(send, status: int, message: str, type: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(message, type=type)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _service_unavailable(scope, receive, send) -> None:
    """uvicorn's app past ``limit_concurrency``: 503 with OpenAI's error body, not its plain text."""
    await _error(send, 503, "the server has as many open connections and requests as it takes "
                            "(--limit-concurrency); retry later", type="service_unavailable")


@dataclass(frozen=True)
class HttpLimits:
    max_request_body_mb: int = field(default=DEFAULT_MAX_BODY_MB, metadata=setting(
        "largest request body in MiB; larger ones get 413", type=int_at_least(1)))
    http_header_timeout: float = field(default=DEFAULT_HEADER_TIMEOUT_S, metadata=setting(
        "seconds a client may take to send a request's headers before the connection is closed",
        type=float_above(0)))
    http_body_timeout: float = field(default=DEFAULT_BODY_TIMEOUT_S, metadata=setting(
        "seconds a client may take to send a request's body before it gets 408", type=float_above(0)))
    limit_concurrency: int = field(default=DEFAULT_LIMIT_CONCURRENCY, metadata=setting(
        "most open connections and requests; more get 503 (uvicorn's --limit-concurrency)", type=int_at_least(1)))


def uvicorn_config(app, host: str, port: int, limits: HttpLimits, **kw) -> uvicorn.Config:
    protocol = type("GuardedHttp", (GuardedHttpProtocol,), {"header_timeout_s": limits.http_header_timeout})
    guarded = RequestLimits(app, limits.max_request_body_mb << 20, limits.http_body_timeout)
    # No uvicorn option for it: httptools looks this module-level name up per request (one for the process).
    httptools_impl.service_unavailable = _service_unavailable
    return uvicorn.Config(guarded, host=host, port=port, log_level="warning", http=protocol,
                          limit_concurrency=limits.limit_concurrency, **kw)
