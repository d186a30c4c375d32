"""Flags several commands take, declared once: a test fails on one flag name with two defaults or help texts."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.argtypes import Flag, float_above, given_flags, int_at_least, setting, zero_or_at_least
from epdserve.serving.deployment import ELASTIC_INTERVAL_S, ELASTIC_MIN_DWELL_S, ELASTIC_WINDOW_S

MODEL_FLAG = Flag("--model", default=None,
                  help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct); 'vlm': the default "
                       "vision-language model (SmolLM2-135M with a SmolVLM vision tower of SYNTHETIC weights)")

# serve's per-role sizes; -tp does not set the encode workers'.
ROLE_TP_FLAGS = (*(
    Flag(f"--{role}-tp", type=int_at_least(1), default=None, metavar="N",
         help=f"pd, epd: tensor-parallel ranks of each {role} worker (default: --tensor-parallel-size); not with "
              f"--elastic (docs/tensor-parallel.md)")
    for role in ("prefill", "decode")),
    Flag("--encode-tp", type=int_at_least(1), default=None, metavar="N",
         help="epd: tensor-parallel ranks of each encode worker, its vision tower's heads and MLP split among "
              "them (default: 1; --tensor-parallel-size does not apply) (docs/tensor-parallel.md)"))

CORES_FLAG = Flag("--cores", default=None, metavar="LIST",
                  help="CPU cores, comma-separated, e.g. 0,1: serve splits them among its workers, a worker pins "
                       "itself to them (default: every core this process may use)")
EVENTS_FLAG = Flag("--events", default=None, metavar="ADDR",
                   help="ZeroMQ address the router binds for its workers' events (a worker's --router). Default: "
                        "router, tcp://127.0.0.1:5557; serve, ipc in a private directory (--cluster ray: tcp:// on "
                        "this node's Ray IP, a free port); e.g. tcp://127.0.0.1:5557 lets other workers join")
ALLOW_OVERSUBSCRIPTION_FLAG = Flag(
    "--allow-oversubscription", action="store_true", default=False,
    help="start workers whose estimated memory (model weights + --kv-cache-memory-mb each) exceeds the host's "
         "available memory (compare: passed to each epdserve serve)")
ELASTIC_FLAG = Flag("--elastic", action="store_true", default=False,
                    help="workers switch role live (colocated, prefill, decode) as the load shifts (docs/elastic.md). "
                         "serve, router: colocated or pd, --mode and the worker counts give the starting roles "
                         "(--cluster ray: every elastic worker takes --worker-resources and --worker-placement); "
                         "worker: keep the KV cache shareable and serve KV whatever the role")


@dataclass(frozen=True)
class ElasticTimings:
    """The elastic controller's settings (serve and router run it, plan simulates it); None: not given."""
    elastic_window: float | None = field(default=None, metadata=setting(
        "seconds of signals each elastic decision reads (a sliding window; extended back to hold 8 arrivals, up "
        f"to 120 s or the window, at low rates; default {ELASTIC_WINDOW_S:g})", type=float_above(0), metavar="S"))
    elastic_interval: float | None = field(default=None, metadata=setting(
        "seconds between two elastic decisions, 0 or >= 0.1 (0: no controller, roles change only by POST /roles; "
        f"plan simulates a controller, > 0; default {ELASTIC_INTERVAL_S:g})", type=zero_or_at_least(0.1),
        metavar="S"))
    elastic_min_dwell: float | None = field(default=None, metadata=setting(
        "seconds the roles stay as they are after an elastic change before the next "
        f"(default {ELASTIC_MIN_DWELL_S:g})", type=float_above(0), metavar="S"))

    @property
    def window_s(self) -> float:
        return ELASTIC_WINDOW_S if self.elastic_window is None else self.elastic_window

    @property
    def interval_s(self) -> float:
        return ELASTIC_INTERVAL_S if self.elastic_interval is None else self.elastic_interval

    @property
    def min_dwell_s(self) -> float:
        return ELASTIC_MIN_DWELL_S if self.elastic_min_dwell is None else self.elastic_min_dwell

    def given(self) -> list[str]:
        return given_flags(self)
