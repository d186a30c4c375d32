"""Deployments by name: the one parser of the names ``epdserve compare --configs`` and
``epdserve plan`` take, the ``epdserve serve`` flags each name means, and the worker
placement ``epdserve serve`` applies to a deployment on a set of CPU cores.

Names (:data:`NAME_FORMS`):

* ``colocated`` — one colocated worker (serve's defaults: chunked prefill, 2,048 tokens
  a step);
* ``colocated-N`` — N colocated replicas (N >= 1);
* ``colocated-chunked`` — one colocated worker whose chunked prefill takes at most
  :data:`CHUNKED_BATCHED_TOKENS` tokens per step;
* ``pd`` — prefill/decode disaggregation, one prefill and one decode worker;
* ``XpYd`` — X prefill and Y decode workers (the field's xPyD notation; X, Y >= 1);
* ``XeYpZd`` — EPD: X encode, Y prefill and Z decode workers (X, Y, Z >= 1);
* ``pd-localN`` — ``pd`` whose prompts under N tokens are prefilled on the decode worker
  (N >= 0);
* ``elastic`` — two workers that change role live (``serve --elastic``), starting
  colocated; ``elastic-N``: N such workers (N >= 2). Placed and given cores as
  ``colocated-N`` (so ``elastic`` runs on the workers and cores of ``colocated-2``);
* any of them with the suffix ``-noprefix`` (once): prefix caching off (on by default, as
  in vLLM).

This module imports nothing heavier than the standard library, so that light clients
(``epdserve compare``, ``epdserve plan``) can use it without torch or the router.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, get_args

from epdserve.argtypes import Options

# A worker's role. An engine worker's (every role but encode) is the one an elastic worker
# switches between.
Role = Literal["colocated", "prefill", "decode", "encode"]
EngineRole = Literal["colocated", "prefill", "decode"]
Mode = Literal["colocated", "pd", "epd"]
ROLES: tuple[str, ...] = get_args(Role)
ENGINE_ROLES: tuple[str, ...] = get_args(EngineRole)
MODES: tuple[str, ...] = get_args(Mode)
# The roles a mode's deployment needs a live worker of.
MODE_ROLES = {"colocated": ("colocated",), "pd": ("prefill", "decode"), "epd": ("encode", "prefill", "decode")}

# The SLOs an elastic server's controller steers by (``serve --slo``); compare judges by more.
ELASTIC_SLO_KEYS = ("ttft", "tpot")
# Those SLOs without --slo: compare's defaults (bench.metrics.DEFAULT_SLOS_MS).
ELASTIC_SLOS_MS = {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0}
# The elastic controller's settings without their flags (s): the sliding window of signals a
# decision reads, the time between decisions, and the least time between two changes. The
# planner's simulated controller takes the same.
ELASTIC_WINDOW_S = 20.0
ELASTIC_INTERVAL_S = 2.0
ELASTIC_MIN_DWELL_S = 30.0

# colocated-chunked's token budget per step, an eighth of serve's default: a long prompt
# then stalls the decodes batched with it by one 256-token step at a time.
CHUNKED_BATCHED_TOKENS = 256

NOPREFIX = "-noprefix"
NAME_FORMS = ("colocated", "colocated-N", "colocated-chunked", "pd", "XpYd", "XeYpZd", "pd-localN",
              "elastic", "elastic-N")
NAME_HELP = (f"expected one of: {', '.join(NAME_FORMS)}, with an optional {NOPREFIX} suffix "
             f"(X, Y, Z and colocated-N's N: worker counts >= 1; elastic-N's N: workers >= 2; "
             f"pd-localN's N: prompt tokens >= 0; e.g. colocated-2, 2p1d, 1e1p1d, pd-local64, elastic-3)")
# An elastic deployment without a count: two workers, the fewest that can split prefill
# from decode.
ELASTIC_WORKERS = 2

_COUNT = r"([1-9][0-9]*)"
_COLOCATED_N = re.compile(rf"colocated-{_COUNT}")
_XPYD = re.compile(rf"{_COUNT}p{_COUNT}d")
_XEYPZD = re.compile(rf"{_COUNT}e{_COUNT}p{_COUNT}d")
_PD_LOCAL = re.compile(r"pd-local([0-9]+)")
_ELASTIC_N = re.compile(rf"elastic-{_COUNT}")

Placement = list[tuple[str, str, list[int]]]  # (role, worker id, cores) of each worker


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment: its mode, worker counts and the scheduler settings a name encodes.

    A worker count of None means the name does not spell it out (``colocated``, ``pd``,
    ``pd-localN``): serve's default of one worker per role applies. It is kept apart from
    an explicit 1 so that ``colocated-1`` and ``1p1d`` keep their names and flags.

    Attributes:
        mode: ``colocated``, ``pd`` or ``epd`` (:data:`MODES`).
        workers: colocated replicas (colocated only).
        encode: encode workers (epd only).
        prefill: prefill workers (pd, epd).
        decode: decode workers (pd, epd).
        chunked_prefill: :data:`CHUNKED_BATCHED_TOKENS` tokens per step (serve's chunked
            prefill in smaller steps than its default).
        local_prefill_threshold: pd, tokens: a prompt shorter than this is prefilled on the
            decode worker (serve's ``--local-prefill-threshold``); None: not set (serve's 0).
        prefix_caching: prefix caching on (serve's default) or off.
        elastic: the workers change role live (serve's ``--elastic``); the mode and counts
            are the starting roles. A colocated elastic deployment without ``workers`` has
            :data:`ELASTIC_WORKERS`.

    Raises:
        ValueError: (on construction) an unknown mode, a count below 1, a count the mode
            has no workers for, a negative threshold, or an elastic deployment in epd mode
            or of fewer than 2 workers.
    """

    mode: str = "colocated"
    workers: int | None = None
    encode: int | None = None
    prefill: int | None = None
    decode: int | None = None
    chunked_prefill: bool = False
    local_prefill_threshold: int | None = None
    prefix_caching: bool = True
    elastic: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: expected one of {', '.join(MODES)}")
        counts = {"workers": self.workers, "encode": self.encode, "prefill": self.prefill, "decode": self.decode}
        if any(n is not None and n < 1 for n in counts.values()):
            raise ValueError("every worker count must be at least 1")
        roles = {"colocated": ("workers",), "pd": ("prefill", "decode"), "epd": ("encode", "prefill", "decode")}
        extra = [k for k, n in counts.items() if n is not None and k not in roles[self.mode]]
        if extra:
            raise ValueError(f"mode {self.mode} has no {', '.join(extra)} count")
        if self.local_prefill_threshold is not None and self.local_prefill_threshold < 0:
            raise ValueError(f"local prefill threshold {self.local_prefill_threshold}: must be >= 0")
        if self.elastic and (self.mode == "epd" or self.num_workers < 2):
            raise ValueError(f"an elastic deployment needs colocated or pd workers, at least 2 "
                             f"(got {self.mode} with {self.num_workers})")

    @classmethod
    def parse(cls, name: str) -> DeploymentSpec:
        """The deployment a name means (forms: module doc).

        Raises:
            ValueError: an unknown name or a bad count (``elastic-1``); the message names
                it and lists every accepted form.
        """
        base = name.removesuffix(NOPREFIX)
        try:
            spec = cls._parse_base(base)
        except ValueError as exc:
            raise ValueError(f"deployment {name!r}: {exc}; {NAME_HELP}") from None
        if spec is None:
            raise ValueError(f"unknown deployment {name!r}: {NAME_HELP}")
        return spec if base == name else replace(spec, prefix_caching=False)

    @classmethod
    def _parse_base(cls, base: str) -> DeploymentSpec | None:
        """A name without its ``-noprefix`` suffix, or None when it is not one."""
        if base in ("colocated", "pd"):
            return cls(base)
        if base == "colocated-chunked":
            return cls("colocated", chunked_prefill=True)
        if m := _COLOCATED_N.fullmatch(base):
            return cls("colocated", workers=int(m[1]))
        if m := _XPYD.fullmatch(base):
            return cls("pd", prefill=int(m[1]), decode=int(m[2]))
        if m := _XEYPZD.fullmatch(base):
            return cls("epd", encode=int(m[1]), prefill=int(m[2]), decode=int(m[3]))
        if m := _PD_LOCAL.fullmatch(base):
            return cls("pd", local_prefill_threshold=int(m[1]))
        if base == "elastic":
            return cls("colocated", elastic=True)
        if m := _ELASTIC_N.fullmatch(base):
            return cls("colocated", workers=int(m[1]), elastic=True)  # ValueError below 2
        return None

    @classmethod
    def from_serve_args(cls, args: Options) -> DeploymentSpec:
        """The deployment of parsed ``epdserve serve`` options: ``mode``, the worker counts
        of the mode (``workers``; ``encode_workers``, ``prefill_workers``,
        ``decode_workers``), ``local_prefill_threshold`` (0: None), ``enable_prefix_caching``
        (None: on) and ``elastic`` (absent: False): what places the workers. Such a
        deployment need not have a name (:attr:`name`).

        Raises:
            ValueError: any worker count below 1 (those of other modes too), an unknown
                mode, or an elastic deployment serve cannot switch (see the class doc).
        """
        counts = {"workers": args.workers, "encode": args.encode_workers,
                  "prefill": args.prefill_workers, "decode": args.decode_workers}
        if min(counts.values()) < 1:
            raise ValueError("every worker count must be at least 1")
        roles = {"colocated": ("workers",), "pd": ("prefill", "decode"),
                 "epd": ("encode", "prefill", "decode")}.get(args.mode, ())
        return cls(args.mode, **{k: counts[k] for k in roles},
                   local_prefill_threshold=getattr(args, "local_prefill_threshold", 0) or None,
                   prefix_caching=getattr(args, "enable_prefix_caching", None) is not False,
                   elastic=bool(getattr(args, "elastic", False)))

    @property
    def name(self) -> str:
        """The canonical name: ``DeploymentSpec.parse(spec.name) == spec``.

        Raises:
            ValueError: a deployment no name stands for (e.g. epd in 256-token steps).
        """
        if self.elastic and self.mode == "colocated":
            base = f"elastic-{self.workers}" if self.workers is not None else "elastic"
        elif self.mode == "colocated":
            base = ("colocated-chunked" if self.chunked_prefill else
                    f"colocated-{self.workers}" if self.workers is not None else "colocated")
        elif self.mode == "pd":
            base = (f"pd-local{self.local_prefill_threshold}" if self.local_prefill_threshold is not None else
                    f"{self.prefill}p{self.decode}d" if self.prefill is not None else "pd")
        else:
            base = f"{self.encode}e{self.prefill}p{self.decode}d"
        name = base + ("" if self.prefix_caching else NOPREFIX)
        try:
            if DeploymentSpec.parse(name) == self:
                return name
        except ValueError:
            pass
        raise ValueError(f"{self}: no deployment name stands for it ({NAME_HELP})")

    @property
    def max_num_batched_tokens(self) -> int | None:
        """Tokens per engine step: :data:`CHUNKED_BATCHED_TOKENS` for ``colocated-chunked``,
        else None (serve's default)."""
        return CHUNKED_BATCHED_TOKENS if self.chunked_prefill else None

    def counts(self) -> dict[str, int]:
        """Workers per role (``colocated``, ``encode``, ``prefill``, ``decode``) that serve
        starts, in that order; a count the name leaves out is serve's default, 1."""
        if self.mode == "colocated":
            return {"colocated": self.workers or (ELASTIC_WORKERS if self.elastic else 1)}
        roles = {"prefill": self.prefill or 1, "decode": self.decode or 1}
        return {"encode": self.encode or 1, **roles} if self.mode == "epd" else roles

    @property
    def num_workers(self) -> int:
        """How many workers serve starts for this deployment."""
        return sum(self.counts().values())

    def serve_flags(self) -> list[str]:
        """The ``epdserve serve`` options of this deployment: ``--mode``, the worker counts
        the name spells out, the step's token budget, the local prefill
        threshold, ``--no-enable-prefix-caching``; nothing for what is serve's default.
        An elastic deployment gets ``--elastic`` and always its worker count (serve's
        default of 1 worker is not elastic's); its SLOs (``--slo``) are the caller's to add."""
        flags = ["--elastic"] if self.elastic else []
        flags += ["--mode", self.mode]
        workers = self.counts()["colocated"] if self.elastic and self.mode == "colocated" else self.workers
        for opt, n in (("--workers", workers), ("--encode-workers", self.encode),
                       ("--prefill-workers", self.prefill), ("--decode-workers", self.decode)):
            if n is not None:
                flags += [opt, str(n)]
        if self.chunked_prefill:
            flags += ["--max-num-batched-tokens", str(CHUNKED_BATCHED_TOKENS)]
        if self.local_prefill_threshold is not None:
            flags += ["--local-prefill-threshold", str(self.local_prefill_threshold)]
        if not self.prefix_caching:
            flags.append("--no-enable-prefix-caching")
        return flags

    def place(self, cores: list[int]) -> Placement:
        """Where serve puts each worker of this deployment on ``cores`` (:func:`plan_workers`).

        Raises:
            ValueError: no cores.
        """
        counts = self.counts()
        return plan_workers(self.mode, cores, workers=counts.get("colocated", 1), prefill=counts.get("prefill", 1),
                            decode=counts.get("decode", 1), encode=counts.get("encode", 1))


def natural_order(worker_id: str) -> list:
    """Sort key of worker ids that puts worker-2 before worker-10 (digit runs compare as
    numbers)."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", worker_id))]


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """Cores of each of ``n`` workers: contiguous near-equal groups if ``n <= len(cores)``,
    else worker i gets ``cores[i % len(cores)]`` (round-robin sharing)."""
    if n <= len(cores):
        size, extra = divmod(len(cores), n)
        starts = [i * size + min(i, extra) for i in range(n + 1)]
        return [cores[starts[i]:starts[i + 1]] for i in range(n)]
    return [[cores[i % len(cores)]] for i in range(n)]


def plan_workers(mode: str, cores: list[int], *, workers: int = 1, prefill: int = 1,
                 decode: int = 1, encode: int = 1) -> Placement:
    """``(role, worker_id, cores)`` for each worker of ``mode`` (placement rule: the module
    doc of :mod:`epdserve.serving.launch.launcher`).

    Raises:
        ValueError: no cores, a worker count below 1, or an unknown mode.
    """
    if not cores:
        raise ValueError("no CPU cores to place workers on")
    if min(workers, prefill, decode, encode) < 1:
        raise ValueError("every worker count must be at least 1")
    if mode == "colocated":
        return [("colocated", f"colocated-{i}", c) for i, c in enumerate(split_cores(cores, workers))]
    if mode in ("pd", "epd"):
        half = max(1, len(cores) // 2)
        first, plan = cores[:half], []
        if mode == "epd":
            split = max(1, len(first) // 2)
            plan = [("encode", f"encode-{i}", c) for i, c in enumerate(split_cores(first[:split], encode))]
            first = first[split:] or first
        return (plan + [("prefill", f"prefill-{i}", c) for i, c in enumerate(split_cores(first, prefill))]
                + [("decode", f"decode-{i}", c) for i, c in enumerate(split_cores(cores[half:] or cores, decode))])
    raise ValueError(f"unknown mode {mode!r}")
