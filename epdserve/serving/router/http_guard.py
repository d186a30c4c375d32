"""HTTP limits that keep one client from holding the router: request head and body
deadlines, a body size limit and a connection limit.

uvicorn closes an idle keep-alive connection, but sets no deadline on a request that has
started: a client that sends half its headers (slowloris) or half its body holds a
connection, and an ASGI task waiting on ``receive()``, for as long as it likes. Here:

* :class:`GuardedHttpProtocol` (uvicorn's httptools protocol) closes a connection whose
  request head is not complete ``header_timeout_s`` seconds after the connection opened or
  the request's first byte arrived;
* :class:`RequestLimits` (ASGI middleware) answers **413** to a body over
  ``max_body_bytes`` (from ``Content-Length`` before reading, else while reading) and
  **408** to a body not complete ``body_timeout_s`` seconds after its head, both with an
  OpenAI-style error body;
* uvicorn's ``limit_concurrency`` answers 503 past that many connections or requests,
  with an OpenAI-style error body too (:func:`_service_unavailable` replaces its plain text).

:func:`uvicorn_config` builds the server configuration with all three for ``epdserve
serve`` and ``epdserve router``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from epdserve.argtypes import Options, float_above, int_at_least
from epdserve.serving.api.errors import error_body

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_BODY_MB = 64  # 8 images at the 20 MB image limit need more: raise it for those
DEFAULT_LIMIT_CONCURRENCY = 1024


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request head:
    ``header_timeout_s`` (class attribute, set by :func:`uvicorn_config`) from the
    connection's start or the request's first byte to the end of its headers; past it the
    connection is closed (no response: the client has not finished asking)."""

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
    """ASGI middleware: reads each request's body before the app sees the request, and
    answers itself, with an OpenAI error body, **413** to a body of more than
    ``max_body_bytes`` bytes (from ``Content-Length`` before reading anything, else as soon
    as the bytes read pass it) and **408** to a body not complete ``body_timeout_s`` seconds
    after the request head. The app then gets the body in one message; later reads (a
    streaming response waiting for the client's disconnect) go to the connection untouched."""

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
    """A ``receive`` that returns ``messages`` first, then reads the connection."""
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
    """The ASGI app uvicorn answers a request with past ``limit_concurrency``: 503 with
    OpenAI's error body (uvicorn's own says "Service Unavailable" in plain text)."""
    await _error(send, 503, "the server has as many open connections and requests as it takes "
                            "(--limit-concurrency); retry later", type="service_unavailable")


def add_http_options(parser: argparse.ArgumentParser) -> None:
    """The HTTP limits' flags (``epdserve serve`` and ``epdserve router``)."""
    parser.add_argument("--max-request-body-mb", type=int_at_least(1), default=DEFAULT_MAX_BODY_MB,
                        help="largest request body in MiB; larger ones get 413")
    parser.add_argument("--http-header-timeout", type=float_above(0), default=DEFAULT_HEADER_TIMEOUT_S,
                        help="seconds a client may take to send a request's headers before the connection is closed")
    parser.add_argument("--http-body-timeout", type=float_above(0), default=DEFAULT_BODY_TIMEOUT_S,
                        help="seconds a client may take to send a request's body before it gets 408")
    parser.add_argument("--limit-concurrency", type=int_at_least(1), default=DEFAULT_LIMIT_CONCURRENCY,
                        help="most open connections and requests; more get 503 (uvicorn's --limit-concurrency)")


def uvicorn_config(app, args: Options, **kw) -> uvicorn.Config:
    """A uvicorn configuration serving ``app`` on ``args.host:args.port`` behind
    :class:`RequestLimits` and :class:`GuardedHttpProtocol`, with ``args``' HTTP limits
    (see :func:`add_http_options`); ``kw`` go to ``uvicorn.Config``."""
    protocol = type("GuardedHttp", (GuardedHttpProtocol,), {"header_timeout_s": args.http_header_timeout})
    guarded = RequestLimits(app, args.max_request_body_mb << 20, args.http_body_timeout)
    # The httptools protocol looks its 503 app up by this module-level name for each request
    # past limit_concurrency (uvicorn has no option for it); in the router's process every
    # uvicorn server is this one. (tests/test_api_surface.py checks the body.)
    httptools_impl.service_unavailable = _service_unavailable
    return uvicorn.Config(guarded, host=args.host, port=args.port, log_level="warning", http=protocol,
                          limit_concurrency=args.limit_concurrency, **kw)
