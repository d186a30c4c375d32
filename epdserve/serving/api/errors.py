"""OpenAI's error body everywhere the router answers one (docs/serving.md, Errors)."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("epdserve.api")

# Parsing holds the event loop: a 60 MB body of small ints stalled every stream 14 s. The
# largest valid request has well under a tenth of this.
MAX_JSON_VALUES = 1 << 18


class APIError(Exception):
    """``param``: the offending request field; ``code``: OpenAI's error code string, or None.
    Raises TypeError (constructor) for another ``code``."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        if code is not None and not isinstance(code, str):
            raise TypeError(f"an error code is a string or None (OpenAI's), not {code!r}")
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def field_error(param: str, message: str) -> PydanticCustomError:
    """For a check across fields: names the 400's ``param`` (a model validator's errors name none)."""
    return PydanticCustomError("field_error", "{message}", {"param": param, "message": message})


class BoundedJSONRoute(APIRoute):
    """413 before parsing past :data:`MAX_JSON_VALUES` values, counted as ``,`` and ``:`` bytes
    (milliseconds, where parsing took seconds; those inside strings count too)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def bounded(request: Request):
            body = await request.body()  # cached on the request: the handler reads it again
            values = body.count(b",") + body.count(b":")
            if values > MAX_JSON_VALUES:
                raise APIError(f"request body has about {values} JSON values, over the limit of "
                               f"{MAX_JSON_VALUES}", status=413)
            return await handler(request)

        return bounded


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if first.get("type") == "field_error":  # see field_error
        loc = [first["ctx"]["param"]]
    param = loc[0] if loc else None
    where = ".".join(loc) or "request body"
    text = f"{where}: {msg}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI, on_bad_request=None) -> None:
    """Validation errors and invalid JSON → 400 (not FastAPI's 422), anything unexpected → 500;
    ``on_bad_request()`` is called for each 400."""

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
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # The exception's text stays in the log: it can name internals (paths, peers).
        ref = uuid.uuid4().hex[:12]
        log.error("internal error %s on %s %s", ref, request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"internal server error (reference {ref} in the server log)",
                                       type="internal_server_error"), status_code=500)
