"""The composition root: a :class:`Router` made of a registry, its ZeroMQ port and events
loop, and the OpenAI front, from a model and options; and the ``epdserve router`` command
(run alone: workers started elsewhere connect to ``--events``; ``epdserve serve`` starts
it together with its workers)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import uvicorn

from epdserve.argtypes import Options, float_above, int_at_least, mm_limit_images, slo_pair
from epdserve.model.loader import ModelLoadError, generation_defaults, resolve_model
from epdserve.model.tokenizer import check_chat_template, load_tokenizer, read_chat_template, template_renders_tools
from epdserve.serving import auth
from epdserve.serving.elastic.policy import PolicyConfig
from epdserve.serving.deployment import ELASTIC_SLO_KEYS, ELASTIC_SLOS_MS, MODE_ROLES
from epdserve.serving.flags import (ELASTIC_FLAG, EVENTS_FLAG, add_elastic_flags, add_router_flags, elastic_given,
                                    elastic_settings)
from epdserve.serving.handshake import model_fingerprint, model_kv_shape
from epdserve.serving.router.http_guard import add_http_options, uvicorn_config
from epdserve.serving.metrics import DEFAULT_METRICS_PREFIX, RouterMetrics, add_metrics_options
from epdserve.serving.api.multimodal import DEFAULT_MAX_IMAGES, ImagePrompter, MediaOptions
from epdserve.serving.router import surface
from epdserve.serving.elastic.scaling import ScalingConfig
from epdserve.serving.router.elastic import Controller, Scaler, Workforce
from epdserve.serving.router.flows import FlowConfig
from epdserve.serving.router.front import Front
from epdserve.serving.router.prefix_index import DEFAULT_POLICY, POLICIES, make_policy
from epdserve.serving.router.registry import Compat, Registry, WorkerState
from epdserve.serving.router.routes import create_app
from epdserve.serving.router.signals import SignalRecorder
from epdserve.serving.router.zmq_port import EventsLoop, ZmqPort
from epdserve.serving.api.tool_calls import ToolSettings, add_tool_options, tool_settings

log = logging.getLogger("epdserve.router")
# The events address of `epdserve router` without --events.
ROUTER_EVENTS = "tcp://127.0.0.1:5557"


class Router:
    """A router's parts, wired: ``registry`` (workers, requests in flight), ``port`` and
    ``events`` (ZeroMQ), ``front`` (requests to flows), ``metrics``.

    ``mode`` is "colocated", "pd" or "epd"; ``model`` a :class:`~epdserve.model.loader.ModelInfo`;
    ``events_addr`` the ZeroMQ address the PULL socket binds (``tcp://...`` or
    ``ipc://...``). A worker silent for ``worker_timeout_s`` seconds is considered dead;
    a request with no output for ``request_timeout_s`` seconds fails. ``auth_token``: if
    set, every frame both ways is sealed with keys derived from it and a worker's Hello
    must carry its HMAC (see :mod:`epdserve.serving.auth`, ``epdserve.serving.handshake``);
    ``internal_encryption`` "curve": TCP sockets use CURVE (needs the token).
    ``local_prefill_threshold`` (pd, tokens): a prompt shorter than this goes straight to a
    decode worker, which prefills it itself; 0 disaggregates every prompt. ``tools``: the
    tool-calling options (:func:`~epdserve.serving.api.tool_calls.tool_settings`).
    ``sampling_defaults``: request field defaults (``--generation-config``), applied to the
    fields a request does not set. ``api_keys``: the keys ``Authorization: Bearer`` must
    give on the model's endpoints (empty: none needed; see :mod:`.surface`).
    ``metrics_prefix``: the names on /metrics (see :class:`~epdserve.serving.metrics.RouterMetrics`).
    ``routing``: how a request's first worker is chosen among its role's, one of
    :data:`~epdserve.serving.router.prefix_index.POLICIES`. ``elastic``: workers switch
    roles live (docs/elastic.md), decided every ``elastic_interval_s`` seconds (0: only
    when asked, ``POST /roles``) by the policy under ``elastic_policy``'s SLOs and window.

    Raises (constructor):
        ValueError: an unknown mode or routing policy, CURVE without a token or without libzmq
            support, or elastic with epd.
    """

    def __init__(self, mode: str, model, tokenizer, events_addr: str, *, trace_file: str | None = None,
                 worker_timeout_s: float = 5.0, request_timeout_s: float = 600.0,
                 auth_token: str | None = None, local_prefill_threshold: int = 0,
                 media: MediaOptions = MediaOptions(), internal_encryption: str = "none",
                 tools: ToolSettings = ToolSettings(), sampling_defaults: dict | None = None,
                 api_keys: tuple[str, ...] = (), metrics_prefix: str = DEFAULT_METRICS_PREFIX,
                 routing: str = DEFAULT_POLICY, elastic: bool = False, elastic_interval_s: float = 0.0,
                 elastic_policy: PolicyConfig | None = None):
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
                                      routing=make_policy(routing), elastic=elastic, signals=signals),
                           images=images, metrics=self.metrics, trace_file=trace_file, tools=tools,
                           sampling_defaults=sampling_defaults)
        self.controller = None
        if elastic and elastic_interval_s > 0:
            self.controller = Controller(self.registry, signals, elastic_policy or PolicyConfig(**ELASTIC_SLOS_MS),
                                         elastic_interval_s, self.front.write_trace)
        self.workforce: Workforce | None = None

    def enable_scaling(self, scaler: Scaler | None, min_workers: int, max_workers: int,
                       startup_timeout_s: float) -> None:
        """Elastic: let ``POST /workers``, ``DELETE /workers/{id}`` and the controller (when
        ``max_workers`` > ``min_workers``) add and retire workers through ``scaler`` (None:
        retire only) within ``[min_workers, max_workers]``; call before :meth:`start`.

        Raises:
            ValueError: not elastic, or bounds that are not 1 <= min <= max.
        """
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
        """The registry's workers, by id."""
        return self.registry.workers

    def live(self, w: WorkerState) -> bool:
        """True unless ``w`` is down."""
        return self.registry.live(w)

    def mark_dead(self, worker_id: str, reason: str) -> None:
        """See :meth:`Registry.mark_dead`."""
        self.registry.mark_dead(worker_id, reason)

    def shutdown_workers(self) -> None:
        """Ask every live worker to exit (used by the launcher that owns them)."""
        self.registry.shutdown_workers()

    def bind(self) -> None:
        """Bind the events socket (idempotent). Raises zmq.ZMQError if the address is taken."""
        self.events.bind()

    async def start(self) -> None:
        """Bind the events socket and start reading it. Raises zmq.ZMQError if the address is taken."""
        await self.events.start()
        if self.controller is not None:
            self.controller.start()
        if self.workforce is not None:
            self.workforce.start()

    async def stop(self) -> None:
        """Stop reading events, drop queued preprocessing and close every socket."""
        if self.controller is not None:
            await self.controller.stop()
        if self.workforce is not None:
            await self.workforce.stop()
        await self.events.stop()
        self.front.close()
        self.port.close()


# ------------------------------------------------------------------------ sub-command

def add_router_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``epdserve router`` and ``epdserve serve``."""
    parser.add_argument("--mode", choices=list(MODE_ROLES), default="colocated",
                        help="colocated: one worker role; pd: prefill and decode workers; epd: encode, prefill "
                             "and decode workers (a vision-language model)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--limit-images-per-prompt", type=int_at_least(0), default=DEFAULT_MAX_IMAGES,
                        help="most images one request may carry")
    parser.add_argument("--limit-mm-per-prompt", dest="limit_images_per_prompt", type=mm_limit_images,
                        default=argparse.SUPPRESS, metavar="JSON",
                        help="vLLM's form of --limit-images-per-prompt: '{\"image\": N}' or image=N "
                             "(video and audio: 0)")
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="directory image_url file paths may be read from (default: none)")
    parser.add_argument("--allow-remote-images", action="store_true",
                        help="fetch http(s) image URLs (lets clients make the server fetch any reachable address)")
    parser.add_argument("--trace-file", default=None, help="append one JSON line per finished request")
    parser.add_argument("--worker-timeout", type=float_above(0), default=5.0,
                        help="seconds without any message (workers send a heartbeat every 0.5 s) "
                             "after which a worker counts as down; counted only while the router can read, so "
                             "a stall of the router is not blamed on its workers")
    parser.add_argument("--request-timeout", type=float_above(0), default=600.0,
                        help="seconds without output after which a request fails")
    parser.add_argument("--local-prefill-threshold", type=int_at_least(0), default=0,
                        help="pd: prompts shorter than this many tokens are prefilled by a decode worker "
                             "itself, without a KV hand-off (0: never)")
    parser.add_argument("--routing", choices=POLICIES, default=DEFAULT_POLICY,
                        help="how a request's first worker (colocated or prefill) is chosen among its role's: "
                             "least-loaded (fewest outstanding requests; default: no state, no hashing, best "
                             "when prompts share little) or prefix-aware (the worker believed to hold the longest "
                             "leading run of the prompt's KV blocks, unless load is imbalanced; as SGLang's "
                             "cache-aware router). Decode workers are always least-loaded")
    elastic = parser.add_argument_group("elastic serving (docs/elastic.md)")
    ELASTIC_FLAG.add(elastic)
    elastic.add_argument("--slo", nargs="+", type=slo_pair(ELASTIC_SLO_KEYS, positive=True), default=None,
                         metavar="KEY:MS",
                         help="the SLOs the elastic controller serves, as bench --goodput writes them, each key "
                              "once: ttft:MS tpot:MS (default: "
                              f"{' '.join(f'{k[4:-3]}:{v:g}' for k, v in ELASTIC_SLOS_MS.items())})")
    add_elastic_flags(elastic)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_router_flags(parser)  # --model and vLLM's front flags (--served-model-name, --api-key, ...)
    add_metrics_options(parser)
    add_http_options(parser)
    add_tool_options(parser)
    auth.add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``epdserve router``'s options."""
    add_router_options(parser)
    EVENTS_FLAG.add(parser)


def build_router(args: Options, events_addr: str) -> Router:
    """Resolve the model (as :func:`served_model`), load its tokenizer, read the request
    defaults of ``--generation-config`` and make a Router from parsed options.

    Raises:
        ModelLoadError: the model cannot be found or read, a bad ``--max-model-len``, a
            ``--generation-config`` that cannot be read or holds a value no request could, or
            a bad ``--chat-template`` or tool option.
    """
    policy = elastic_policy(args)
    model = served_model(args)
    error = mode_error(args, model)
    if error:
        raise ModelLoadError(error)
    media = MediaOptions(max_images=args.limit_images_per_prompt, allowed_local_dir=args.allowed_local_media_path,
                         allow_remote=args.allow_remote_images)
    try:
        tokenizer = load_tokenizer(model.path, args.chat_template and read_chat_template(args.chat_template))
        check_chat_template(tokenizer)
        tools = tool_settings(args, template_renders_tools(tokenizer))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    defaults = surface.checked_defaults(generation_defaults(args.generation_config, model.path),
                                        args.generation_config)
    return Router(args.mode, model, tokenizer, events_addr, trace_file=args.trace_file,
                  worker_timeout_s=args.worker_timeout, request_timeout_s=args.request_timeout,
                  auth_token=args.auth_token, local_prefill_threshold=args.local_prefill_threshold, media=media,
                  internal_encryption=args.internal_encryption, tools=tools, sampling_defaults=defaults,
                  api_keys=surface.api_keys(args.api_key), metrics_prefix=args.metrics_prefix,
                  routing=args.routing, elastic=args.elastic, elastic_interval_s=elastic_settings(args)[1],
                  elastic_policy=policy)


def elastic_policy(args: Options) -> PolicyConfig:
    """The elastic controller's policy settings of ``--slo`` and ``--elastic-*``.

    Raises:
        ModelLoadError: one of them given without ``--elastic``, an SLO key given twice, or
            settings the policy refuses (see :class:`PolicyConfig`).
    """
    given = ["--slo"] * (args.slo is not None) + elastic_given(args)
    if given and not args.elastic:
        raise ModelLoadError(f"{', '.join(given)}: the elastic controller's settings apply only with --elastic")
    keys = [k for k, _ in args.slo or []]
    if twice := sorted({k for k in keys if keys.count(k) > 1}):
        raise ModelLoadError(f"--slo: {', '.join(twice)} given more than once")
    slos = dict(ELASTIC_SLOS_MS, **{f"slo_{k}_ms": v for k, v in (args.slo or [])})
    try:
        window_s, _, min_dwell_s = elastic_settings(args)
        return PolicyConfig(**slos, window_s=window_s, min_dwell_s=min_dwell_s)
    except ValueError as exc:  # what the flags' types let through and the policy refuses
        raise ModelLoadError(f"--slo / --elastic-*: {exc}") from None


def mode_error(args: Options, model) -> str | None:
    """What is wrong with ``--mode`` (and ``--elastic``) for ``model`` (a ``ModelInfo``):
    EPD needs a vision-language model and cannot be elastic. None when nothing is."""
    if args.elastic and args.mode == "epd":
        return "--elastic switches colocated, prefill and decode workers: use --mode colocated or pd"
    if args.mode == "epd" and not model.multimodal:
        return f"--mode epd needs a vision-language model (e.g. --model vlm), not {model.name}"
    return None


def served_model(args: Options):
    """The model of ``--model`` as served: named by ``--served-model-name`` (the first is
    reported, every one accepted), its context window cut to ``--max-model-len``.

    Raises:
        ModelLoadError: the model cannot be found or read, or ``--max-model-len`` is over
            its context window (as vLLM refuses it).
    """
    model = resolve_model(args.model)
    if args.max_model_len is not None:
        if args.max_model_len > model.max_model_len:
            raise ModelLoadError(f"--max-model-len {args.max_model_len} is over the context window of "
                                 f"{model.name}, {model.max_model_len} tokens")
        model = dataclasses.replace(model, max_model_len=args.max_model_len)
    if args.served_model_name:
        names = tuple(dict.fromkeys(args.served_model_name))  # in order, once each
        model = dataclasses.replace(model, name=names[0], served_names=names)
    return model


def setup_logging(level: str) -> None:
    """Log to stderr at ``level`` ("debug" .. "error"), one timestamped line per record."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run(args: Options) -> int:
    """``epdserve router``: serve HTTP; workers started elsewhere connect to ``--events``.
    Returns 2 on a bad option or model (``--events`` on TCP needs a token unless
    ``--allow-unauthenticated``)."""
    setup_logging(args.log_level)
    events = args.events or ROUTER_EVENTS
    error = auth.options_error(args, [events] if events.startswith("tcp://") else [])
    if error is not None:
        print(f"epdserve router: error: {error}", file=sys.stderr)
        return 2
    try:
        router = build_router(args, events)
    except ModelLoadError as exc:
        print(f"epdserve router: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(router)
    log.info("router (%s, %s) on http://%s:%d; waiting for workers on %s (frames %s%s)", args.mode,
             router.model.name, args.host, args.port, events,
             "sealed" if router.keyring.enabled else "NOT authenticated", ", CURVE" if router.keyring.curve else "")
    uvicorn.Server(uvicorn_config(app, args)).run()
    return 0
