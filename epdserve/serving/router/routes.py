"""The router's HTTP routes: OpenAI chat and text completions (streamed or not),
``/v1/models``, ``/health`` and ``/metrics``; and, from :mod:`.surface`, vLLM's
``/tokenize``, ``/detokenize``, ``/version`` and the ``--api-key`` check."""

from __future__ import annotations

import contextlib
import time
import uuid

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from epdserve.serving.api import openai as api
from epdserve.serving.api.responses import now_s
from epdserve.serving.router.answer import Answer
from epdserve.serving.router.elastic import ScaleRefused, strands_decodes
from epdserve.serving.router.events import WorkerFailed
from epdserve.serving.router.front import Front
from epdserve.serving.router import surface
from epdserve.serving.api.errors import APIError, BoundedJSONRoute, install_error_handlers
from epdserve.serving.deployment import MODE_ROLES, EngineRole

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


class Completions:

    def __init__(self, front: Front):
        self.front = front

    async def serve(self, http_request: Request, body, kind: str):
        """Raises APIError: 400; 503 (no live worker, a full queue); a worker failing before
        the answer started (its status)."""
        front = self.front
        t_arrival = front.config.clock()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        choices = await front.admit(body, kind, rid, t_arrival)
        try:
            for c in choices:
                c.flow.start()
        except Exception as exc:
            # No choice may stay registered (held by a worker, counted in flight) without a client.
            for c in choices:
                c.flow.fail(exc)
                front.request_log.ended(c.flow)
            if isinstance(exc, WorkerFailed):
                raise exc.api_error() from None
            raise
        answer = Answer(rid, choices, body, kind, front.model.name, front.request_log, front.token_text)
        return answer.streamed() if body.stream else await answer.whole(http_request)


def model_cards(model) -> list[dict]:
    """One per served name, the first first (vLLM's); ``root``: the directory of the
    tokenizer files and config.json, for tools that load the tokenizer."""
    return [model_card(model, name) for name in model.served_names or (model.name,)]


def model_card(model, name: str) -> dict:
    card = {"id": name, "object": "model", "created": now_s(), "owned_by": "epdserve",
            "root": str(model.path), "parent": None, "max_model_len": model.max_model_len,
            "input_modalities": ["text", "image"] if model.multimodal else ["text"]}
    if model.synthetic_vision:
        card["synthetic_vision"] = True
        card["note"] = SYNTHETIC_VISION_NOTE
    return card


def create_app(router) -> FastAPI:
    """``router``: a :class:`~epdserve.serving.router.app.Router`, started and stopped by the
    app's lifespan."""

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
    """``POST /roles`` (docs/elastic.md): 409 on a static server or when no other worker
    could take over the decoding; 404, not live. Answers the worker's /health entry."""
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
    """``POST /workers``, ``DELETE /workers/{id}`` (docs/elastic.md): 409 without an elastic
    ``serve``, at a bound or retiring already; 404, not live; 503, no worker could start;
    401 without a valid ``--api-key``."""

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
