"""The composition root: a :class:`Router` wired from its registry, ZeroMQ port, events loop and OpenAI front;
and ``epdserve router`` (alone: workers started elsewhere connect to ``--events``)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass

import uvicorn

from epdserve.argtypes import add_flags, field_of, nested
from epdserve.model.loader import ModelLoadError, generation_defaults, resolve_model
from epdserve.model.tokenizer import check_chat_template, load_tokenizer, read_chat_template, template_renders_tools
from epdserve.serving import auth
from epdserve.serving.elastic.policy import PolicyConfig
from epdserve.serving.deployment import ELASTIC_SLOS_MS, MODE_ROLES
from epdserve.serving.flags import EVENTS_FLAG
from epdserve.serving.handshake import model_fingerprint, model_kv_shape
from epdserve.serving.router.http_guard import uvicorn_config
from epdserve.serving.metrics import DEFAULT_METRICS_PREFIX, RouterMetrics
from epdserve.serving.api.multimodal import ImagePrompter, MediaOptions
from epdserve.serving.router import surface
from epdserve.serving.elastic.scaling import ScalingConfig
from epdserve.serving.router.elastic import Controller, Scaler, Workforce
from epdserve.serving.router.flows import FlowConfig
from epdserve.serving.router.front import Front
from epdserve.serving.router.options import ElasticOptions, RouterOptions
from epdserve.serving.router.prefix_index import DEFAULT_POLICY, make_policy
from epdserve.serving.router.registry import Compat, Registry, WorkerState
from epdserve.serving.router.routes import create_app
from epdserve.serving.router.signals import SignalRecorder
from epdserve.serving.router.zmq_port import EventsLoop, ZmqPort
from epdserve.serving.api.tool_calls import ToolSettings, tool_settings

log = logging.getLogger("epdserve.router")
ROUTER_EVENTS = "tcp://127.0.0.1:5557"


class Router:
    """Seconds: a worker silent ``worker_timeout_s`` is down; a request without output ``request_timeout_s`` fails;
    elastic decisions every ``elastic_interval_s`` (0: only on ``POST /roles``). ``local_prefill_threshold`` (pd,
    tokens): shorter prompts are prefilled by a decode worker (0: never). ``auth_token``: every frame both ways is
    sealed with it (:mod:`epdserve.serving.auth`); ``internal_encryption`` "curve" needs it.

    Raises:
        ValueError: an unknown mode or routing policy, CURVE without a token or libzmq support, or elastic with epd.
    """

    def __init__(self, mode: str, model, tokenizer, events_addr: str, *, trace_file: str | None = None,
                 worker_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 auth_token: str | None = None, local_prefill_threshold: int = 0,
                 media: MediaOptions = MediaOptions(), internal_encryption: str = "none",
                 tools: ToolSettings = ToolSettings(), sampling_defaults: dict | None = None,
                 api_keys: tuple[str, ...] = (), metrics_prefix: str = DEFAULT_METRICS_PREFIX,
                 routing: str = DEFAULT_POLICY, elastic: bool = False, elastic_interval_s: float = 0.0,
                 elastic_policy: PolicyConfig | None = None, migration_limit: int = 0):
        if mode not in MODE_ROLES:
            raise ValueError(f"unknown mode {mode!r} (expected one of {', '.join(MODE_ROLES)})")
        self.mode, self.model, self.events_addr, self.api_keys = mode, model, events_addr, api_keys
        self.keyring = auth.Keyring(auth_token, curve=internal_encryption == "curve")
        # A vision-language model's image layout; None: requests with images get a 400.
        images = ImagePrompter(model.path, tokenizer, media) if model.multimodal else None
        compat = Compat(model_fingerprint(model.path), model_kv_shape(model.path),
                        images.embedding_shape if images else None, auth_token)
        self.metrics = RouterMetrics(model.name, metrics_prefix, model.max_model_len)
        self.port = ZmqPort(self.keyring)
        self.registry = Registry(mode, self.port, compat, worker_timeout_s=worker_timeout_s, metrics=self.metrics,
                                 elastic=elastic, on_event=lambda line: self.front.write_trace(line))
        self.events = EventsLoop(self.registry, self.keyring, events_addr, self.port)
        signals = SignalRecorder() if elastic else None
        self.front = Front(model, tokenizer, self.registry,
                           FlowConfig(mode, request_timeout_s=request_timeout_s,
                                      local_prefill_threshold=local_prefill_threshold,
                                      routing=make_policy(routing), elastic=elastic, signals=signals,
                                      migration_limit=migration_limit),
                           images=images, metrics=self.metrics, trace_file=trace_file, tools=tools,
                           sampling_defaults=sampling_defaults)
        self.controller = None
        if elastic and elastic_interval_s > 0:
            self.controller = Controller(self.registry, signals, elastic_policy or PolicyConfig(**ELASTIC_SLOS_MS),
                                         elastic_interval_s, self.front.write_trace)
        self.workforce: Workforce | None = None

    def enable_scaling(self, scaler: Scaler | None, min_workers: int, max_workers: int,
                       startup_timeout_s: float) -> None:
        """Elastic: ``POST /workers``, ``DELETE /workers/{id}`` and the controller add and retire workers
        through ``scaler`` (None: retire only) within ``[min_workers, max_workers]``; call before :meth:`start`.
        Raises ValueError: not elastic, or not 1 <= min <= max."""
        if not self.registry.elastic:
            raise ValueError("adding and retiring workers needs an elastic router (--elastic)")
        self.workforce = Workforce(self.registry, scaler, min_workers, max_workers, startup_timeout_s,
                                   self.front.write_trace)
        if self.controller is not None and max_workers > min_workers:
            policy = self.controller.config
            self.controller.workforce = self.workforce
            self.controller.scaling = ScalingConfig(min_workers, max_workers, policy.slo_ttft_ms, policy.slo_tpot_ms,
                                                    window_s=policy.window_s, min_dwell_s=policy.min_dwell_s,
                                                    evidence_s=max(policy.window_s - self.controller.interval_s,
                                                                   policy.window_s / 2))

    @property
    def workers(self) -> dict[str, WorkerState]:
        return self.registry.workers

    def live(self, w: WorkerState) -> bool:
        return self.registry.live(w)

    def mark_dead(self, worker_id: str, reason: str) -> None:
        self.registry.mark_dead(worker_id, reason)

    def shutdown_workers(self) -> None:
        self.registry.shutdown_workers()

    def bind(self) -> None:
        """Idempotent. Raises zmq.ZMQError: the address is taken."""
        self.events.bind()

    async def start(self) -> None:
        """Raises zmq.ZMQError: the address is taken."""
        await self.events.start()
        if self.controller is not None:
            self.controller.start()
        if self.workforce is not None:
            self.workforce.start()

    async def stop(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        if self.workforce is not None:
            await self.workforce.stop()
        await self.events.stop()
        self.front.close()
        self.port.close()


@dataclass(frozen=True)
class RouterCommand:
    router: RouterOptions = nested(RouterOptions)
    events: str | None = field_of(EVENTS_FLAG)


OPTIONS = RouterCommand


def add_router_options(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RouterOptions)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, RouterCommand)


@dataclass(frozen=True)
class RouterInputs:
    """What :func:`build_router` makes a router of, each checked: the served model (``resolve_model``'s),
    its tokenizer, and the settings read from files and flags."""
    model: object
    tokenizer: object
    media: MediaOptions
    tools: ToolSettings
    sampling_defaults: dict
    policy: PolicyConfig


def router_inputs(options: RouterOptions) -> RouterInputs:
    """Raises ModelLoadError: the model cannot be found or read, or a bad ``--max-model-len``,
    ``--generation-config``, ``--chat-template`` or tool option."""
    policy = elastic_policy(options.elastic)
    model = served_model(options)
    error = mode_error(options, model)
    if error:
        raise ModelLoadError(error)
    media = MediaOptions(max_images=options.limit_images_per_prompt,
                         allowed_local_dir=options.allowed_local_media_path, allow_remote=options.allow_remote_images)
    tools = options.tools
    try:
        tokenizer = load_tokenizer(model.path, tools.chat_template and read_chat_template(tools.chat_template))
        check_chat_template(tokenizer)
        tool_calls = tool_settings(tools.enable_auto_tool_choice, tools.tool_call_parser,
                                   template_renders_tools(tokenizer))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    defaults = surface.checked_defaults(generation_defaults(options.generation_config, model.path),
                                        options.generation_config)
    return RouterInputs(model, tokenizer, media, tool_calls, defaults, policy)


def build_router(options: RouterOptions, events_addr: str) -> Router:
    """Raises ModelLoadError as :func:`router_inputs`."""
    return router_from(options, events_addr, router_inputs(options))


def router_from(options: RouterOptions, events_addr: str, given: RouterInputs) -> Router:
    return Router(options.mode, given.model, given.tokenizer, events_addr, trace_file=options.trace_file,
                  worker_timeout_s=options.worker_timeout, request_timeout_s=options.request_timeout,
                  auth_token=options.auth.auth_token, local_prefill_threshold=options.local_prefill_threshold,
                  media=given.media, internal_encryption=options.auth.internal_encryption, tools=given.tools,
                  sampling_defaults=given.sampling_defaults, api_keys=surface.api_keys(options.api_key),
                  metrics_prefix=options.metrics_prefix, routing=options.routing, elastic=options.elastic.elastic,
                  elastic_interval_s=options.elastic.timings.interval_s, elastic_policy=given.policy,
                  migration_limit=options.migration_limit)


def elastic_policy(options: ElasticOptions) -> PolicyConfig:
    """Raises ModelLoadError: ``--slo`` or ``--elastic-*`` without ``--elastic``, an SLO key twice, or
    settings :class:`PolicyConfig` refuses."""
    given = ["--slo"] * (options.slo is not None) + options.timings.given()
    if given and not options.elastic:
        raise ModelLoadError(f"{', '.join(given)}: the elastic controller's settings apply only with --elastic")
    keys = [k for k, _ in options.slo or []]
    if twice := sorted({k for k in keys if keys.count(k) > 1}):
        raise ModelLoadError(f"--slo: {', '.join(twice)} given more than once")
    slos = dict(ELASTIC_SLOS_MS, **{f"slo_{k}_ms": v for k, v in (options.slo or [])})
    try:
        return PolicyConfig(**slos, window_s=options.timings.window_s, min_dwell_s=options.timings.min_dwell_s)
    except ValueError as exc:
        raise ModelLoadError(f"--slo / --elastic-*: {exc}") from None


def mode_error(options: RouterOptions, model) -> str | None:
    """None when ``--mode`` and ``--elastic`` fit ``model``: EPD needs a vision-language model and no ``--elastic``."""
    if options.elastic.elastic and options.mode == "epd":
        return "--elastic switches colocated, prefill and decode workers: use --mode colocated or pd"
    if options.mode == "epd" and not model.multimodal:
        return f"--mode epd needs a vision-language model (e.g. --model vlm), not {model.name}"
    return None


def served_model(options: RouterOptions):
    """Named by ``--served-model-name`` (the first reported, each accepted), its window cut to ``--max-model-len``.
    Raises ModelLoadError: the model cannot be read, or ``--max-model-len`` is over its window (as vLLM)."""
    model = resolve_model(options.model)
    if options.max_model_len is not None:
        if options.max_model_len > model.max_model_len:
            raise ModelLoadError(f"--max-model-len {options.max_model_len} is over the context window of "
                                 f"{model.name}, {model.max_model_len} tokens")
        model = dataclasses.replace(model, max_model_len=options.max_model_len)
    if options.served_model_name:
        names = tuple(dict.fromkeys(options.served_model_name))
        model = dataclasses.replace(model, name=names[0], served_names=names)
    return model


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(command: RouterCommand) -> int:
    """Returns 2 on a bad option or model (``--events`` on TCP needs a token unless ``--allow-unauthenticated``)."""
    options = command.router
    setup_logging(options.log_level)
    events = command.events or ROUTER_EVENTS
    error = auth.options_error(options.auth, [events] if events.startswith("tcp://") else [])
    if error is not None:
        print(f"epdserve router: error: {error}", file=sys.stderr)
        return 2
    try:
        router = build_router(options, events)
    except ModelLoadError as exc:
        print(f"epdserve router: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(router)
    log.info("router (%s, %s) on http://%s:%d; waiting for workers on %s (frames %s%s)", options.mode,
             router.model.name, options.host, options.port, events,
             "sealed" if router.keyring.enabled else "NOT authenticated", ", CURVE" if router.keyring.curve else "")
    uvicorn.Server(uvicorn_config(app, options.host, options.port, options.http)).run()
    return 0
