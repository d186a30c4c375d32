"""The router's options, taken by ``epdserve router`` and ``epdserve serve``: each field is
its flag (``argtypes.setting``), named as ``vllm serve`` names it where vLLM has one."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from epdserve.argtypes import (Flag, field_of, float_above, int_at_least, mm_limit_images, nested, setting,
                               slo_pair, tokens_at_least)
from epdserve.serving.api.multimodal import DEFAULT_MAX_IMAGES
from epdserve.serving.api.tool_calls import PARSERS
from epdserve.serving.auth import AuthOptions
from epdserve.serving.deployment import ELASTIC_SLO_KEYS, ELASTIC_SLOS_MS, MODE_ROLES
from epdserve.serving.flags import ELASTIC_FLAG, MODEL_FLAG, ElasticTimings
from epdserve.serving.metrics import DEFAULT_METRICS_PREFIX, METRICS_PREFIXES
from epdserve.serving.router.http_guard import HttpLimits
from epdserve.serving.router.prefix_index import DEFAULT_POLICY, POLICIES

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic controller's: ``--elastic``, ``--slo`` (ms) and ``--elastic-*`` (s)."""
    elastic: bool = field_of(ELASTIC_FLAG)
    slo: list[tuple[str, float]] | None = field(default=None, metadata=setting(
        "the SLOs the elastic controller serves, as bench --goodput writes them, each key once: ttft:MS tpot:MS "
        f"(default: {' '.join(f'{k[4:-3]}:{v:g}' for k, v in ELASTIC_SLOS_MS.items())})",
        nargs="+", type=slo_pair(ELASTIC_SLO_KEYS, positive=True), metavar="KEY:MS"))
    timings: ElasticTimings = nested(ElasticTimings)


@dataclass(frozen=True)
class ToolOptions:
    """vLLM's tool-calling flags."""
    chat_template: str | None = field(default=None, metadata=setting(
        "Jinja chat template (a file, or the template itself) to use instead of the model's; one with a tool "
        "format (e.g. examples/templates/hermes_tools.jinja) enables `tools`", metavar="FILE"))
    enable_auto_tool_choice: bool = field(default=False, metadata=setting(
        'let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser', action="store_true"))
    tool_call_parser: str | None = field(default=None, metadata=setting(
        "format of the model's tool calls: hermes, <tool_call>{json}</tool_call> blocks", choices=PARSERS))


DEFAULT_MIGRATION_LIMIT = 3


@dataclass(frozen=True)
class RouterOptions:
    """The OpenAI front's options. Units: seconds, tokens, MiB as each flag says."""
    mode: str = field(default="colocated", metadata=setting(
        "colocated: one worker role; pd: prefill and decode workers; epd: encode, prefill and decode workers (a "
        "vision-language model)", choices=list(MODE_ROLES)))
    host: str = field(default="127.0.0.1", metadata=setting("HTTP address to listen on"))
    port: int = field(default=8000, metadata=setting("HTTP port (0: any free port)", type=int))
    limit_images_per_prompt: int = field(default=DEFAULT_MAX_IMAGES, metadata=setting(
        "most images one request may carry", type=int_at_least(0), also=(Flag(
            "--limit-mm-per-prompt", dest="limit_images_per_prompt", type=mm_limit_images,
            default=argparse.SUPPRESS, metavar="JSON",
            help="vLLM's form of --limit-images-per-prompt: '{\"image\": N}' or image=N (video and audio: 0)"),)))
    allowed_local_media_path: str | None = field(default=None, metadata=setting(
        "directory image_url file paths may be read from (default: none)", metavar="DIR"))
    allow_remote_images: bool = field(default=False, metadata=setting(
        "fetch http(s) image URLs (lets clients make the server fetch any reachable address)", action="store_true"))
    trace_file: str | None = field(default=None, metadata=setting("append one JSON line per finished request"))
    worker_timeout: float = field(default=5.0, metadata=setting(
        "seconds without any message (workers send a heartbeat every 0.5 s) after which a worker counts as down; "
        "counted only while the router can read, so a stall of the router is not blamed on its workers",
        type=float_above(0)))
    request_timeout: float = field(default=600.0, metadata=setting(
        "seconds without output after which a request fails", type=float_above(0)))
    migration_limit: int = field(default=DEFAULT_MIGRATION_LIMIT, metadata=setting(
        "times a request whose worker dies mid-stream moves to a live worker of the role, its prompt and the tokens "
        "already sent computed again there (Dynamo's flag; 0: such a request fails; one whose worker dies before its "
        "first token is retried either way)",
        type=int_at_least(0)))
    local_prefill_threshold: int = field(default=0, metadata=setting(
        "pd: prompts shorter than this many tokens are prefilled by a decode worker itself, without a KV hand-off "
        "(0: never)", type=int_at_least(0)))
    routing: str = field(default=DEFAULT_POLICY, metadata=setting(
        "how a request's first worker (colocated or prefill) is chosen among its role's: least-loaded (fewest "
        "outstanding requests; default: no state, no hashing, best when prompts share little) or prefix-aware (the "
        "worker believed to hold the longest leading run of the prompt's KV blocks, unless load is imbalanced; as "
        "SGLang's cache-aware router). Decode workers are always least-loaded", choices=POLICIES))
    elastic: ElasticOptions = nested(ElasticOptions, "elastic serving (docs/elastic.md)")
    log_level: str = field(default="info", metadata=setting("log level", choices=LOG_LEVELS))
    model: str | None = field_of(MODEL_FLAG)
    served_model_name: list[str] | None = field(default=None, metadata=setting(
        "the model's names in the API (vLLM's): the first is the name in responses and /v1/models, each is "
        "accepted as a request's model (default: the model file's or directory's name)", nargs="+",
        metavar="NAME"))
    api_key: list[str] | None = field(default=None, metadata=setting(
        "require 'Authorization: Bearer KEY' (one of these keys) on /v1/*, /tokenize and /detokenize; missing or "
        "wrong: 401 (default: $EPDSERVE_API_KEY, else $VLLM_API_KEY, else no key)", nargs="+", metavar="KEY"))
    max_model_len: int | None = field(default=None, metadata=setting(
        "context window in tokens (prompt + max_tokens), at most the model's; 4096, 4k (4,000) or 4K (4,096) as "
        "vLLM's (default: the model's)", type=tokens_at_least(1)))
    generation_config: str = field(default="auto", metadata=setting(
        "request defaults (temperature, top_p, top_k, repetition_penalty, min_p, max_new_tokens as max_tokens) "
        "from generation_config.json: auto, the model's; vllm, none; or that of FOLDER (vLLM's); a request's own "
        "values win", metavar="auto|vllm|FOLDER"))
    metrics_prefix: str = field(default=DEFAULT_METRICS_PREFIX, metadata=setting(
        "names on /metrics: vllm (vLLM's vllm:* names, labels and meanings, the deployment as one server: vLLM's "
        "Grafana dashboard and gateway scrapers read them), epdserve (the same names as epdserve:*, per worker and "
        "stage), or both (default); epdserve's own metrics (KV transfer, worker_up, ...) are epdserve:* always",
        choices=METRICS_PREFIXES))
    http: HttpLimits = nested(HttpLimits)
    tools: ToolOptions = nested(ToolOptions)
    auth: AuthOptions = nested(AuthOptions)
