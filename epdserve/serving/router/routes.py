"""The router's HTTP routes: OpenAI chat and text completions (streamed or not),
``/v1/models``, ``/health`` and ``/metrics``; and, from :mod:`.surface`, vLLM's
``/tokenize``, ``/detokenize``, ``/version`` and the ``--api-key`` check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from epdserve.serving import openai_api as api
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.front import Choice, Front, failed, merged
from epdserve.serving.router import surface
from epdserve.serving.router.registry import MODE_ROLES

log = logging.getLogger("epdserve.router")

SYNTHETIC_VISION_NOTE = ("the vision tower has SYNTHETIC (seeded random) weights: the language model is real, "
                         "but what it says about images carries no meaning")


class SSEResponse(StreamingResponse):
    """A server-sent-event stream that notices a client going away even while no token
    flows, and always closes its generator (whose ``finally`` frees the request)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.create_task(stream()), asyncio.create_task(listen())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await self.body_iterator.aclose()
        for exc in results:
            if isinstance(exc, Exception) and not isinstance(exc, OSError):
                log.error("stream failed: %s: %s", type(exc).__name__, exc)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Completions:
    """The completion endpoints' handlers over ``front``."""

    def __init__(self, front: Front):
        self.front = front

    async def serve(self, http_request: Request, body, kind: str):
        """Answer one chat (``kind`` "chat") or text completion request.

        Raises:
            APIError: a bad request (400), no live worker or a full queue (503), a worker
                failing before the answer started (its status).
        """
        front = self.front
        t_arrival = front.config.clock()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        choices = await front.admit(body, kind, rid, t_arrival)
        try:
            for c in choices:
                c.gen.start()
        except Exception as exc:
            # Whatever failed, no choice may stay registered (held by a worker, counted in
            # flight) without a client: every one is finished here.
            failed(choices, exc)
            for c in choices:
                front.finish(c.gen)
            if isinstance(exc, WorkerFailed):
                raise exc.api_error() from None
            raise
        if body.stream:
            return SSEResponse(self.stream_events(rid, choices, body, kind))
        return await self.complete(http_request, rid, choices, kind)

    async def stream_events(self, rid: str, choices: list[Choice], body, kind: str):
        """The SSE chunks of a streamed answer; an error after the start is one error event."""
        front = self.front
        model, created, usage = front.model.name, api.now_s(), body.include_usage
        try:
            if kind == "chat":
                for c in choices:
                    yield api.sse(api.chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                                 include_usage=usage, index=c.index))
            async with contextlib.aclosing(merged(choices)) as events:
                async for i, delta, finish, entries in events:
                    lp = choices[i].logprobs_object(entries)
                    if kind == "chat":
                        chunk = api.chat_chunk(rid, model, created, {"content": delta} if delta else {},
                                               finish, include_usage=usage, index=i, logprobs=lp)
                    else:
                        chunk = api.completion_chunk(rid, model, created, delta, finish, include_usage=usage,
                                                     index=i, logprobs=lp)
                    yield api.sse(chunk)
            if usage:
                obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                yield api.sse(api.usage_chunk(rid, model, created, obj, len(choices[0].gen.prompt_ids),
                                              sum(c.gen.output_tokens for c in choices),
                                              choices[0].gen.cached_tokens))
            yield api.SSE_DONE
        except WorkerFailed as exc:
            failed(choices, exc)
            err = exc.api_error()
            yield api.sse(api.error_body(err.message, type=err.type, code=err.status))
            yield api.SSE_DONE
        finally:
            for c in choices:
                front.finish(c.gen)

    async def complete(self, http_request: Request, rid: str, choices: list[Choice], kind: str) -> Response:
        """A non-streamed answer; 499 (read by nobody) if the client goes away first.

        Raises:
            APIError: a worker failed the request (its status).
        """
        task = asyncio.create_task(self._collect(choices))
        watch = asyncio.create_task(_wait_disconnect(http_request))
        try:
            await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                return Response(status_code=499)  # the client is gone; nobody reads this
            try:
                task.result()
            except WorkerFailed as exc:
                failed(choices, exc)
                raise exc.api_error() from None
        finally:
            for t in (task, watch):
                t.cancel()
            await asyncio.gather(task, watch, return_exceptions=True)
            for c in choices:
                self.front.finish(c.gen)
        build, choice = ((api.chat_completion, api.chat_choice) if kind == "chat"
                         else (api.text_completion, api.completion_choice))
        return JSONResponse(build(rid, self.front.model.name, api.now_s(),
                                  [choice(c.index, "".join(c.parts), c.gen.finish_reason,
                                          c.logprobs_object(c.entries)) for c in choices],
                                  len(choices[0].gen.prompt_ids), sum(c.gen.output_tokens for c in choices),
                                  choices[0].gen.cached_tokens))

    @staticmethod
    async def _collect(choices: list[Choice]) -> None:
        async with contextlib.aclosing(merged(choices)) as events:
            async for i, delta, _, entries in events:
                choices[i].parts.append(delta)
                choices[i].entries += entries


def model_cards(model) -> list[dict]:
    """``model``'s /v1/models entries (a ModelInfo): one per served name, the first first
    (vLLM's), each with ``root`` the model's directory, where the tokenizer files
    (``tokenizer.json``, ``tokenizer_config.json``) and ``config.json`` lie, so that tools
    can load the tokenizer from it, and ``max_model_len``, the context window."""
    return [model_card(model, name) for name in model.served_names or (model.name,)]


def model_card(model, name: str) -> dict:
    """The /v1/models entry of ``model`` under ``name``."""
    card = {"id": name, "object": "model", "created": api.now_s(), "owned_by": "epdserve",
            "root": str(model.path), "parent": None, "max_model_len": model.max_model_len,
            "input_modalities": ["text", "image"] if model.multimodal else ["text"]}
    if model.synthetic_vision:
        card["synthetic_vision"] = True
        card["note"] = SYNTHETIC_VISION_NOTE
    return card


def create_app(router) -> FastAPI:
    """The FastAPI app of ``router`` (an :class:`~epdserve.serving.router.app.Router`); its
    lifespan starts and stops the router's events task."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="epdserve", lifespan=lifespan)
    app.router.route_class = api.BoundedJSONRoute  # a body of millions of JSON values: 413, unparsed
    app.state.router = router
    api.install_error_handlers(app, on_bad_request=router.metrics.bad_request.inc)
    handlers = Completions(router.front)
    registry = router.registry

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        return await handlers.serve(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        return await handlers.serve(request, body, "completion")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards(router.model)}

    @app.get("/health")
    async def health():
        ok = registry.ready()
        body = {"status": "ok" if ok else "unavailable", "mode": registry.mode, "model": router.model.name,
                "needs": list(MODE_ROLES[registry.mode]), "requests_in_flight": len(registry.requests),
                "workers": registry.health(time.monotonic())}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    surface.install(app, router)  # /tokenize, /detokenize, /version, --api-key

    return app
