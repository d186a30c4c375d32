"""Every flag that more than one command takes, defined once: its type, choices, default
and help, so that ``epdserve serve`` refuses a bad value (exit 2, naming it) before it
starts any worker, exactly as ``epdserve worker`` would.

* :data:`WORKER_FLAGS`: the engine worker's flags, the engine's declared by its config's
  fields (``engine/config.py``), then the worker's own. ``epdserve worker`` takes them with
  their defaults; ``epdserve serve`` takes the same flags with default None ("not given")
  and passes to each worker only those given (:func:`worker_argv`), so that the worker's
  own default holds otherwise.
* :data:`MODEL_FLAG`: ``--model``, taken by ``serve``, ``router`` and ``worker``.
* :data:`ROUTER_FLAGS`: the OpenAI front's flags, taken by ``serve`` and ``router``, named
  as ``vllm serve`` names them.
* :data:`ROLE_TP_FLAGS`: serve's ``--prefill-tp``, ``--decode-tp`` and ``--encode-tp``, the tensor-parallel
  size of one role's workers, which serve passes to them as their ``--tensor-parallel-size``.
* the flags of several processes: ``--cores``, ``--events``, ``--allow-oversubscription``
  (serve and compare), ``--elastic`` and the elastic controller's :data:`ELASTIC_FLAGS`
  (serve and router run it, plan simulates it).

The client commands' shared flags (bench, compare, plan) are declared in
:mod:`epdserve.bench.workload`; ``tests/test_flags_once.py`` fails when one flag name has two
defaults or two help texts in any two commands.

Adding a flag is one line in the right table, e.g.
``Flag("--metrics-prefix", default="epdserve", help="...")`` in :data:`ROUTER_FLAGS`; its
value is then ``args.metrics_prefix`` in ``build_router``. ``--config FILE`` (YAML, as
vLLM's) reaches every flag here: see :func:`epdserve.argtypes.config_argv`.
"""

from __future__ import annotations

import argparse

from epdserve.argtypes import Flag, Options, flags_of, float_above, int_at_least, tokens_at_least, zero_or_at_least
from epdserve.engine.config import EngineConfig
from epdserve.serving.deployment import ELASTIC_INTERVAL_S, ELASTIC_MIN_DWELL_S, ELASTIC_WINDOW_S
from epdserve.transfer import handoff, kv_codec

MODEL_FLAG = Flag("--model", default=None,
                  help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct); 'vlm': the default "
                       "vision-language model (SmolLM2-135M with a SmolVLM vision tower of SYNTHETIC weights)")

# The engine's settings are EngineConfig's fields (engine/config.py); the worker's own follow.
WORKER_FLAGS = (
    *flags_of(EngineConfig),
    Flag("--tensor-parallel-size", "-tp", type=int_at_least(1), default=1,
         help="ranks of one engine worker (vLLM's flag), each a process with its share of the model's heads, MLP "
              "columns and vocabulary and of the KV cache; the worker's cores are split among them and its steps "
              "run on all of them (docs/tensor-parallel.md); any engine role (KV handed over between any two sizes); "
              "an encode worker (serve's --encode-tp) splits its vision tower; dense weights (auto: the dense copy)"),
    Flag("--kv-transport", choices=handoff.TRANSPORTS, default="auto",
         help="KV hand-off: shared memory on the same host, TCP otherwise (auto), or one of them"),
    Flag("--kv-transfer-dtype", choices=kv_codec.TRANSFER_DTYPES, default="none",
         help="how a prefill worker sends KV: as cached, bf16, or int8 with per-token, per-head scales"),
    Flag("--kv-layer-pipeline", action="store_true",
         help="a prefill worker writes each layer's KV into the outgoing frame as soon as the layer is "
              "computed (a staged frame instead of its shared KV pool)"),
)

# serve's tensor-parallel size per role, where it differs from --tensor-parallel-size's (pd,
# epd), and the encode workers' (epd), which -tp does not set.
ROLE_TP_FLAGS = (*(
    Flag(f"--{role}-tp", type=int_at_least(1), default=None, metavar="N",
         help=f"pd, epd: tensor-parallel ranks of each {role} worker (default: --tensor-parallel-size); not with "
              f"--elastic (docs/tensor-parallel.md)")
    for role in ("prefill", "decode")),
    Flag("--encode-tp", type=int_at_least(1), default=None, metavar="N",
         help="epd: tensor-parallel ranks of each encode worker, its vision tower's heads and MLP split among "
              "them (default: 1; --tensor-parallel-size does not apply) (docs/tensor-parallel.md)"))

ROUTER_FLAGS = (
    Flag("--served-model-name", nargs="+", default=None, metavar="NAME",
         help="the model's names in the API (vLLM's): the first is the name in responses and /v1/models, "
              "each is accepted as a request's model (default: the model file's or directory's name)"),
    Flag("--api-key", nargs="+", default=None, metavar="KEY",
         help="require 'Authorization: Bearer KEY' (one of these keys) on /v1/*, /tokenize and /detokenize; "
              "missing or wrong: 401 (default: $EPDSERVE_API_KEY, else $VLLM_API_KEY, else no key)"),
    Flag("--max-model-len", type=tokens_at_least(1), default=None,
         help="context window in tokens (prompt + max_tokens), at most the model's; 4096, 4k (4,000) or 4K "
              "(4,096) as vLLM's (default: the model's)"),
    Flag("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
         help="request defaults (temperature, top_p, top_k, repetition_penalty, min_p, max_new_tokens as "
              "max_tokens) from generation_config.json: auto, the model's; vllm, none; or that of FOLDER "
              "(vLLM's); a request's own values win"),
)


CORES_FLAG = Flag("--cores", default=None, metavar="LIST",
                  help="CPU cores, comma-separated, e.g. 0,1: serve splits them among its workers, a worker pins "
                       "itself to them (default: every core this process may use)")
EVENTS_FLAG = Flag("--events", default=None, metavar="ADDR",
                   help="ZeroMQ address the router binds for its workers' events (a worker's --router). Default: "
                        "router, tcp://127.0.0.1:5557; serve, ipc in a private directory (--cluster ray: tcp:// on "
                        "this node's Ray IP, a free port); e.g. tcp://127.0.0.1:5557 lets other workers join")
ALLOW_OVERSUBSCRIPTION_FLAG = Flag(
    "--allow-oversubscription", action="store_true",
    help="start workers whose estimated memory (model weights + --kv-cache-memory-mb each) exceeds the host's "
         "available memory (compare: passed to each epdserve serve)")
ELASTIC_FLAG = Flag("--elastic", action="store_true",
                    help="workers switch role live (colocated, prefill, decode) as the load shifts (docs/elastic.md). "
                         "serve, router: colocated or pd, --mode and the worker counts give the starting roles "
                         "(--cluster ray: every elastic worker takes --worker-resources and --worker-placement); "
                         "worker: keep the KV cache shareable and serve KV whatever the role")
# The elastic controller's settings: serve and router run it, plan simulates it. Default None
# ("not given": serve and router refuse one without --elastic); elastic_settings resolves it.
ELASTIC_FLAGS = (
    Flag("--elastic-window", type=float_above(0), default=None, metavar="S",
         help="seconds of signals each elastic decision reads (a sliding window; extended back to hold 8 "
              f"arrivals, up to 120 s or the window, at low rates; default {ELASTIC_WINDOW_S:g})"),
    Flag("--elastic-interval", type=zero_or_at_least(0.1), default=None, metavar="S",
         help="seconds between two elastic decisions, 0 or >= 0.1 (0: no controller, roles change only by "
              f"POST /roles; plan simulates a controller, > 0; default {ELASTIC_INTERVAL_S:g})"),
    Flag("--elastic-min-dwell", type=float_above(0), default=None, metavar="S",
         help="seconds the roles stay as they are after an elastic change before the next "
              f"(default {ELASTIC_MIN_DWELL_S:g})"),
)
ELASTIC_DEFAULTS = {"elastic_window": ELASTIC_WINDOW_S, "elastic_interval": ELASTIC_INTERVAL_S,
                    "elastic_min_dwell": ELASTIC_MIN_DWELL_S}


def add_elastic_flags(parser) -> None:
    """Add :data:`ELASTIC_FLAGS` (``parser``: a parser or an argument group)."""
    for flag in ELASTIC_FLAGS:
        flag.add(parser)


def elastic_settings(args: Options) -> tuple[float, float, float]:
    """``(window_s, interval_s, min_dwell_s)`` of the ``--elastic-*`` flags, their defaults
    where not given."""
    return tuple(default if getattr(args, name) is None else getattr(args, name)
                 for name, default in ELASTIC_DEFAULTS.items())


def elastic_given(args: Options) -> list[str]:
    """The ``--elastic-*`` flags given in ``args``."""
    return [flag.name for flag in ELASTIC_FLAGS if getattr(args, flag.dest) is not None]


def add_worker_flags(parser: argparse.ArgumentParser, passed: bool = False) -> None:
    """Add :data:`WORKER_FLAGS` (``passed``: as serve takes them, see :meth:`Flag.add`)."""
    for flag in WORKER_FLAGS:
        flag.add(parser, passed)


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """Add :data:`MODEL_FLAG` and :data:`ROUTER_FLAGS` (``serve`` and ``router``)."""
    MODEL_FLAG.add(parser)
    for flag in ROUTER_FLAGS:
        flag.add(parser)


def worker_argv(args: Options, **values) -> list[str]:
    """The worker flags given to serve (``args``), as words of a worker's command line;
    ``values`` replace some (by dest: ``dtype="bfloat16"``)."""
    return [word for flag in (MODEL_FLAG, *WORKER_FLAGS)
            for word in flag.argv(values.get(flag.dest, getattr(args, flag.dest)))]


def worker_default(dest: str):
    """The default of ``epdserve worker``'s flag ``dest`` (serve's help, memory estimate)."""
    return next(f.kwargs.get("default") for f in WORKER_FLAGS if f.dest == dest)
