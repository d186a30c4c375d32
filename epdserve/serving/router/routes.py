"""The router's HTTP routes: OpenAI chat and text completions (streamed or not),
``/v1/models``, ``/health`` and ``/metrics``; and, from :mod:`.surface`, vLLM's
``/tokenize``, ``/detokenize``, ``/version`` and the ``--api-key`` check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from epdserve.serving.api import openai as api
from epdserve.serving.api.logprobs import vllm_prompt_logprobs
from epdserve.serving.router.elastic import ScaleRefused, strands_decodes
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.choices import Choice, best_choices, failed, merged, usage_counts
from epdserve.serving.router.front import Front
from epdserve.serving.router import surface
from epdserve.serving.api.errors import APIError, BoundedJSONRoute, install_error_handlers
from epdserve.serving.deployment import MODE_ROLES, EngineRole

log = logging.getLogger("epdserve.router")

SYNTHETIC_VISION_NOTE = ("the vision tower has SYNTHETIC (seeded random) weights: the language model is real, "
                         "but what it says about images carries no meaning")


# A reason goes to the log and the trace as written: a newline or an escape would forge lines.
NO_CONTROL_CHARACTERS = r"^[^\x00-\x1f\x7f]*$"


class RoleRequest(BaseModel):
    """``POST /roles``: make ``worker_id`` a ``role`` worker (elastic); ``reason`` goes to the
    log and the trace's ``role`` line."""

    model_config = ConfigDict(extra="forbid")
    worker_id: str = Field(max_length=128)
    role: EngineRole
    reason: str | None = Field(default=None, max_length=256, pattern=NO_CONTROL_CHARACTERS)


class WorkerRequest(BaseModel):
    """``POST /workers``: add a ``role`` worker (elastic, within ``--max-workers``);
    ``reason`` goes to the log and the trace's ``role`` line."""

    model_config = ConfigDict(extra="forbid")
    role: EngineRole
    reason: str | None = Field(default=None, max_length=256, pattern=NO_CONTROL_CHARACTERS)


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
        return await self.complete(http_request, rid, choices, body, kind)

    async def stream_events(self, rid: str, choices: list[Choice], body, kind: str):
        """The SSE chunks of a streamed answer (a choice's chunks carry its index: ``prompt
        x n + choice``; ``best_of`` over ``n`` is not streamed); an error after the start is
        one error event with OpenAI's error body."""
        front = self.front
        model, created, usage = front.model.name, api.now_s(), body.include_usage
        announced: set[int] = set()  # chat choices whose role chunk went out
        try:
            async with contextlib.aclosing(merged(choices)) as events:
                async for i, delta, finish, entries in events:
                    choice = choices[i]
                    if kind == "chat" and i not in announced:
                        # With the choice's first output, as vLLM does: a client's TTFT is
                        # its first chunk (vllm bench serve's is), so none goes out earlier.
                        announced.add(i)
                        yield api.sse(api.chat_chunk(rid, model, created, {"role": "assistant", "content": ""},
                                                     include_usage=usage, index=choice.index))
                    delta, entries = choice.shape(delta, entries)
                    if kind == "chat":
                        chunks = chat_chunks(rid, model, created, choice, delta, finish, entries, usage)
                    else:
                        chunks = [api.completion_chunk(rid, model, created, delta, finish, include_usage=usage,
                                                       index=i, logprobs=choice.logprobs_object(entries))]
                    for chunk in chunks:
                        if body.continuous_usage:
                            chunk["usage"] = api.usage(len(choice.gen.prompt_ids), choice.completion_tokens)
                        yield api.sse(chunk)
            if usage:
                obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                yield api.sse(api.usage_chunk(rid, model, created, obj, *usage_counts(choices)))
            yield api.SSE_DONE
        except WorkerFailed as exc:
            failed(choices, exc)
            yield api.sse(exc.api_error().body())
            yield api.SSE_DONE
        finally:
            for c in choices:
                front.finish(c.gen)

    async def complete(self, http_request: Request, rid: str, choices: list[Choice], body, kind: str) -> Response:
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
        return JSONResponse(self.answer(rid, choices, body, kind))

    def answer(self, rid: str, choices: list[Choice], body, kind: str) -> dict:
        """The ``chat.completion`` or ``text_completion`` object of collected ``choices``:
        the best ``n`` per prompt (see :func:`best_choices`), with vLLM's
        ``prompt_logprobs`` where they were computed (completions: per choice; chat: of
        the response, and only when asked)."""
        build = api.chat_completion if kind == "chat" else api.text_completion
        answered = []
        for index, c in best_choices(choices, body.n):
            answered.append(answer(c, kind, index))
            if kind != "chat" and body.prompt_logprobs_k is not None:
                answered[-1]["prompt_logprobs"] = self.prompt_logprobs(c)
        out = build(rid, self.front.model.name, api.now_s(), answered, *usage_counts(choices))
        if kind == "chat" and body.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(choices[0])
        return out

    def prompt_logprobs(self, choice: Choice) -> list[dict | None]:
        """vLLM's ``prompt_logprobs`` of ``choice``'s prompt."""
        return vllm_prompt_logprobs(choice.gen.prompt_ids, choice.gen.prompt_logprobs or [], self.front.token_text)

    @staticmethod
    async def _collect(choices: list[Choice]) -> None:
        async with contextlib.aclosing(merged(choices)) as events:
            async for i, delta, _, entries in events:
                delta, entries = choices[i].shape(delta, entries)
                choices[i].parts.append(delta)
                choices[i].entries += entries


def chat_chunks(rid: str, model: str, created: int, choice: Choice, text: str, finish: str | None,
                entries: list, usage: bool) -> list[dict]:
    """The chat chunks of a choice's new ``text`` (``finish``: its finish reason, if it
    ended): one content delta, or with tools what its parser gives (content, tool call
    deltas; none while it holds text back: the logprob entries then wait for the next)."""
    if choice.tools is None:
        deltas = [{"content": text}] if text else []
    else:
        deltas = choice.tools.feed(text)
        if finish is not None:
            more, finish = choice.tools.finish(finish)
            deltas += more
        if not deltas and finish is None:
            choice.held_entries += entries
            return []
        entries, choice.held_entries = choice.held_entries + entries, []
    deltas = deltas or [{}]
    lp = choice.logprobs_object(entries)
    return [api.chat_chunk(rid, model, created, d, finish if k == len(deltas) - 1 else None, include_usage=usage,
                           index=choice.index, logprobs=lp if k == 0 else None) for k, d in enumerate(deltas)]


def answer(choice: Choice, kind: str, index: int) -> dict:
    """A non-streamed choice of ``kind`` "chat" or "completion", answered as choice ``index``."""
    text, lp = "".join(choice.parts), choice.logprobs_object(choice.entries)
    if kind != "chat":
        return api.completion_choice(index, text, choice.gen.finish_reason, lp)
    if choice.tools is None:
        return api.chat_choice(index, text, choice.gen.finish_reason, lp)
    message, finish = choice.tools.message(text, choice.gen.finish_reason)
    return api.chat_choice(index, None, finish, lp, message=message)


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
    app.router.route_class = BoundedJSONRoute  # a body of millions of JSON values: 413, unparsed
    app.state.router = router
    install_error_handlers(app, on_bad_request=router.metrics.bad_request.inc)
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
        body = {"status": "ok" if ok else "unavailable", "mode": registry.mode, "elastic": registry.elastic,
                "model": router.model.name,
                "needs": list(MODE_ROLES[registry.mode]), "requests_in_flight": len(registry.requests),
                "workers": registry.health(time.monotonic())}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    surface.install(app, router)  # /tokenize, /detokenize, /version, --api-key
    install_roles(app, router)
    install_workers(app, router)

    return app


def install_roles(app: FastAPI, router) -> None:
    """``POST /roles`` (:class:`RoleRequest`): an elastic server's role switch by hand, as the
    controller makes them (docs/elastic.md). 409 on a static server, or for making a prefill
    worker of one whose decoding no other can take over (:func:`~epdserve.serving.router.elastic.strands_decodes`); 404
    for a worker that is not live; 400 for a bad body. Answers the worker's /health entry. A
    switch restarts the controller's minimum dwell, as its own switches do."""
    registry = router.registry

    @app.post("/roles")
    async def set_role(body: RoleRequest):
        """Elastic: switch a worker's role by hand (as the controller does)."""
        if not registry.elastic:
            raise APIError("roles change only on an elastic server (serve --elastic)", status=409,
                               type="conflict")
        w = registry.workers.get(body.worker_id)
        if w is None or not registry.live(w):
            raise APIError(f"no live worker {body.worker_id!r}", status=404, param="worker_id",
                               code="worker_not_found")
        if body.role == "prefill" != w.role and (stranded := strands_decodes(registry, body.worker_id)):
            raise APIError(stranded, status=409, type="conflict", param="role")
        changes = body.role != w.role
        try:
            registry.set_role(body.worker_id, body.role, body.reason or "POST /roles")
        except WorkerFailed as exc:
            raise APIError(str(exc), status=503, type="service_unavailable") from None
        if changes and router.controller is not None:
            router.controller.switched_by_hand(f"POST /roles: {body.worker_id} -> {body.role}")
        return w.as_json(time.monotonic())


def install_workers(app: FastAPI, router) -> None:
    """``POST /workers`` (:class:`WorkerRequest`) adds a worker, ``DELETE /workers/{id}``
    retires one (it finishes what it holds first), within the elastic server's bounds
    (docs/elastic.md, "Adding and removing workers"). 409 on a server without them (not
    elastic, or not started by ``serve``), at a bound or for a worker already retiring;
    404 for a worker that is not live; 400 for a bad body; 503 when the cluster cannot
    start one; 401 without a valid ``--api-key``. Answers ``{"worker_id", "state"}``."""

    def workforce(request: Request):
        if router.api_keys and not surface.APIKeyGuard(None, router.api_keys).authorized(request.headers.raw):
            raise APIError("Incorrect API key provided: pass it as 'Authorization: Bearer KEY'.", status=401,
                               code="invalid_api_key")
        if router.workforce is None:
            raise APIError("workers are added and retired only on an elastic server started by "
                               "`epdserve serve --elastic`", status=409, type="conflict")
        return router.workforce

    def refused(exc: ScaleRefused) -> APIError:
        return APIError(str(exc), status=exc.status, type="service_unavailable" if exc.status == 503 else
                            "conflict" if exc.status == 409 else "invalid_request_error",
                            code="worker_not_found" if exc.status == 404 else None)

    @app.post("/workers")
    async def add_worker(body: WorkerRequest, request: Request):
        """Elastic: add a worker of ``role`` (as the controller does under saturation)."""
        try:
            worker_id = workforce(request).add(body.role, body.reason or "POST /workers")
        except ScaleRefused as exc:
            raise refused(exc) from None
        return {"worker_id": worker_id, "state": "starting", "role": body.role}

    @app.delete("/workers/{worker_id}")
    async def retire_worker(request: Request, worker_id: str = Path(max_length=128)):
        """Elastic: retire a worker (as the controller does at low load)."""
        try:
            workforce(request).retire(worker_id, "DELETE /workers")
        except ScaleRefused as exc:
            raise refused(exc) from None
        return {"worker_id": worker_id, "state": "retiring"}
