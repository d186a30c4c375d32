"""Deployments by name (``epdserve compare --configs``, ``epdserve plan``; the forms: docs/comparing.md), the
``epdserve serve`` flags each means, and where serve places workers on CPU cores (docs/serving.md). Standard
library only, so that ``compare`` and ``plan`` import it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, get_args


# EngineRole: the roles an elastic worker switches between.
Role = Literal["colocated", "prefill", "decode", "encode"]
EngineRole = Literal["colocated", "prefill", "decode"]
Mode = Literal["colocated", "pd", "epd"]
ROLES: tuple[str, ...] = get_args(Role)
ENGINE_ROLES: tuple[str, ...] = get_args(EngineRole)
MODES: tuple[str, ...] = get_args(Mode)
# The roles a mode needs a live worker of.
MODE_ROLES = {"colocated": ("colocated",), "pd": ("prefill", "decode"), "epd": ("encode", "prefill", "decode")}
MODE_TP_FIELDS = {"colocated": ("tp",), "pd": ("prefill_tp", "decode_tp"),
                  "epd": ("encode_tp", "prefill_tp", "decode_tp")}

ELASTIC_SLO_KEYS = ("ttft", "tpot")
# without --slo: compare's defaults (bench.metrics.DEFAULT_SLOS_MS)
ELASTIC_SLOS_MS = {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 200.0}
# The elastic controller's defaults (s), also the planner's simulated controller's.
ELASTIC_WINDOW_S = 20.0
ELASTIC_INTERVAL_S = 2.0
ELASTIC_MIN_DWELL_S = 30.0

# colocated-chunked's tokens per step: serve's smallest default (a machine's own: 256 to 2,048).
CHUNKED_BATCHED_TOKENS = 256

NOPREFIX = "-noprefix"
NAME_FORMS = ("colocated", "colocated-N", "colocated-chunked", "pd", "XpYd", "XeYpZd", "pd-localN",
              "elastic", "elastic-N")
TP_FORMS = {"-tpS": ("colocated", "colocated-N", "pd", "XpYd", "XeYpZd"), "-tpP/D": ("pd", "XpYd", "XeYpZd"),
            "-tpE/P/D": ("XeYpZd",)}
NAME_HELP = (f"expected one of: {', '.join(NAME_FORMS)}; "
             + "; ".join(f"{', '.join(forms)} with an optional {suffix} suffix" for suffix, forms in TP_FORMS.items())
             + f" (S: tensor-parallel ranks of each engine worker; E, P, D: of each encode, prefill, decode worker; "
             f">= 1; encode workers have 1 unless -tpE/P/D says otherwise); then an optional "
             f"{NOPREFIX} suffix (X, Y, Z and colocated-N's N: worker counts >= 1; elastic-N's N: workers >= 2; "
             f"pd-localN's N: prompt tokens >= 0; e.g. colocated-2, 2p1d, 1e1p1d, pd-local64, elastic-3, "
             f"colocated-2-tp2, 1p1d-tp2/1-noprefix, 1e1p1d-tp2/1/1)")
# the fewest workers that can split prefill from decode
ELASTIC_WORKERS = 2

_COUNT = r"([1-9][0-9]*)"
_COLOCATED_N = re.compile(rf"colocated-{_COUNT}")
_XPYD = re.compile(rf"{_COUNT}p{_COUNT}d")
_XEYPZD = re.compile(rf"{_COUNT}e{_COUNT}p{_COUNT}d")
_PD_LOCAL = re.compile(r"pd-local([0-9]+)")
_ELASTIC_N = re.compile(rf"elastic-{_COUNT}")
_TP = re.compile(r"(.*)-tp([0-9]+)(?:/([0-9]+))?(?:/([0-9]+))?")

Placement = list[tuple[str, str, list[int]]]  # (role, worker id, cores) of each worker


@dataclass(frozen=True)
class DeploymentSpec:
    """A None worker count is one the name leaves out (serve's default, 1), kept apart from an explicit 1
    so that ``colocated-1`` and ``1p1d`` keep their names. ``tp``, ``*_tp``: ranks of each worker of the role;
    ``local_prefill_threshold``: tokens (None: unset).

    Raises:
        ValueError: (on construction) a count or size below 1 or of a role the mode lacks, a negative threshold,
            or an elastic deployment in epd mode or of fewer than 2 workers.
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
    tp: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    encode_tp: int = 1

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
        sizes = {"tp": self.tp, "prefill_tp": self.prefill_tp, "decode_tp": self.decode_tp,
                 "encode_tp": self.encode_tp}
        if min(sizes.values()) < 1:
            raise ValueError("every tensor-parallel size must be at least 1")
        extra = [k for k, n in sizes.items() if n != 1 and k not in MODE_TP_FIELDS[self.mode]]
        if extra:
            raise ValueError(f"mode {self.mode} has no {', '.join(extra)} size (colocated: tp; pd: "
                             f"prefill_tp, decode_tp; epd: encode_tp too)")
        if self.local_prefill_threshold is not None and self.local_prefill_threshold < 0:
            raise ValueError(f"local prefill threshold {self.local_prefill_threshold}: must be >= 0")
        if self.elastic and (self.mode == "epd" or self.num_workers < 2):
            raise ValueError(f"an elastic deployment needs colocated or pd workers, at least 2 "
                             f"(got {self.mode} with {self.num_workers})")

    @classmethod
    def parse(cls, name: str) -> DeploymentSpec:
        """Raises ValueError: an unknown name or a bad count, naming it and every accepted form."""
        base = name.removesuffix(NOPREFIX)
        try:
            spec = cls._parse_sized(base)
        except ValueError as exc:
            raise ValueError(f"deployment {name!r}: {exc}; {NAME_HELP}") from None
        if spec is None:
            raise ValueError(f"unknown deployment {name!r}: {NAME_HELP}")
        return spec if base == name else replace(spec, prefix_caching=False)

    @classmethod
    def _parse_sized(cls, base: str) -> DeploymentSpec | None:
        """None: not a name. Raises ValueError: a size below 1, or a ``-tp`` suffix its form does not take."""
        m = _TP.fullmatch(base)
        if m is None:
            return cls._parse_base(base)
        suffix = base[len(m[1]):]
        spec = cls._parse_base(m[1])
        if spec is None:
            if m[1].endswith(NOPREFIX):
                raise ValueError(f"{NOPREFIX} comes after the tensor-parallel suffix ({suffix})")
            return None
        sizes = [int(n) for n in m.groups()[1:] if n is not None]
        if min(sizes) < 1:
            raise ValueError(f"{suffix}: a tensor-parallel size must be >= 1")
        if spec.elastic:
            raise ValueError(f"{suffix}: elastic deployments take no tensor-parallel suffix: their workers "
                             "change role")
        if spec.chunked_prefill or spec.local_prefill_threshold is not None:
            raise ValueError(f"{suffix}: colocated-chunked and pd-localN take no tensor-parallel suffix")
        if spec.mode == "colocated":
            if len(sizes) > 1:
                raise ValueError(f"{suffix}: colocated workers have one size (-tpS), not "
                                 f"{'-tpP/D' if len(sizes) == 2 else '-tpE/P/D'}")
            return replace(spec, tp=sizes[0])
        if len(sizes) == 3:
            if spec.mode != "epd":
                raise ValueError(f"{suffix}: only XeYpZd has encode workers (-tpE/P/D)")
            return replace(spec, encode_tp=sizes[0], prefill_tp=sizes[1], decode_tp=sizes[2])
        return replace(spec, prefill_tp=sizes[0], decode_tp=sizes[-1])

    @classmethod
    def _parse_base(cls, base: str) -> DeploymentSpec | None:
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
            return cls("colocated", workers=int(m[1]), elastic=True)
        return None

    @classmethod
    def placed(cls, mode: str, counts: dict[str, int], tp_sizes: dict[str, int], local_prefill_threshold: int,
               prefix_caching: bool, elastic: bool) -> DeploymentSpec:
        """What serve's options place (it may have no :attr:`name`): ``counts`` and
        ``tp_sizes`` by role (``colocated``, ``encode``, ``prefill``, ``decode``), the mode's
        used. Raises ValueError: a count below 1, an unknown mode, or an elastic deployment
        serve cannot switch."""
        if min(counts.values()) < 1:
            raise ValueError("every worker count must be at least 1")
        roles = {"colocated": ("colocated",), "pd": ("prefill", "decode"),
                 "epd": ("encode", "prefill", "decode")}.get(mode, ())
        tp = {field: tp_sizes["colocated" if field == "tp" else field.removesuffix("_tp")]
              for field in MODE_TP_FIELDS.get(mode, ())}
        return cls(mode, **{"workers" if r == "colocated" else r: counts[r] for r in roles},
                   local_prefill_threshold=local_prefill_threshold or None, prefix_caching=prefix_caching,
                   elastic=elastic, **tp)

    @property
    def name(self) -> str:
        """``DeploymentSpec.parse(spec.name) == spec``. Raises ValueError: no name stands for it."""
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
        tp = (tp_suffix(self.tp, self.tp) if self.mode == "colocated" else
              tp_suffix(self.prefill_tp, self.decode_tp, self.encode_tp))
        name = base + tp + ("" if self.prefix_caching else NOPREFIX)
        try:
            if DeploymentSpec.parse(name) == self:
                return name
        except ValueError:
            pass
        raise ValueError(f"{self}: no deployment name stands for it ({NAME_HELP})")

    @property
    def max_num_batched_tokens(self) -> int | None:
        return CHUNKED_BATCHED_TOKENS if self.chunked_prefill else None

    def counts(self) -> dict[str, int]:
        """Workers per role serve starts, in ``ROLES`` order; a count the name leaves out is 1."""
        if self.mode == "colocated":
            return {"colocated": self.workers or (ELASTIC_WORKERS if self.elastic else 1)}
        roles = {"prefill": self.prefill or 1, "decode": self.decode or 1}
        return {"encode": self.encode or 1, **roles} if self.mode == "epd" else roles

    @property
    def num_workers(self) -> int:
        return sum(self.counts().values())

    def role_tp(self, role: str) -> int:
        return {"colocated": self.tp, "prefill": self.prefill_tp, "decode": self.decode_tp,
                "encode": self.encode_tp}[role]

    def serve_flags(self) -> list[str]:
        """Nothing for serve's defaults; an elastic one always gets its worker count; ``--slo`` is the caller's."""
        flags = ["--elastic"] if self.elastic else []
        flags += ["--mode", self.mode]
        workers = self.counts()["colocated"] if self.elastic and self.mode == "colocated" else self.workers
        for opt, n in (("--workers", workers), ("--encode-workers", self.encode),
                       ("--prefill-workers", self.prefill), ("--decode-workers", self.decode)):
            if n is not None:
                flags += [opt, str(n)]
        sizes = [self.tp] if self.mode == "colocated" else [self.prefill_tp, self.decode_tp]
        if len(set(sizes)) == 1:
            flags += ["--tensor-parallel-size", str(sizes[0])] if sizes[0] > 1 else []
        else:
            flags += [word for opt, n in zip(("--prefill-tp", "--decode-tp"), sizes) if n > 1 for word in (opt, str(n))]
        if self.encode_tp > 1:
            flags += ["--encode-tp", str(self.encode_tp)]
        if self.chunked_prefill:
            flags += ["--max-num-batched-tokens", str(CHUNKED_BATCHED_TOKENS)]
        if self.local_prefill_threshold is not None:
            flags += ["--local-prefill-threshold", str(self.local_prefill_threshold)]
        if not self.prefix_caching:
            flags.append("--no-enable-prefix-caching")
        return flags

    def place(self, cores: list[int]) -> Placement:
        """Raises ValueError: no cores, or a worker with more ranks than cores."""
        counts = self.counts()
        return plan_workers(self.mode, cores, workers=counts.get("colocated", 1), prefill=counts.get("prefill", 1),
                            decode=counts.get("decode", 1), encode=counts.get("encode", 1), tp=self.tp,
                            prefill_tp=self.prefill_tp, decode_tp=self.decode_tp, encode_tp=self.encode_tp)


def tp_suffix(prefill_tp: int, decode_tp: int, encode_tp: int = 1) -> str:
    """As ``epdserve plan`` writes names: ``-tpE/P/D`` when E > 1, else ``""``, ``-tpS`` or ``-tpP/D``."""
    if encode_tp != 1:
        return f"-tp{encode_tp}/{prefill_tp}/{decode_tp}"
    if prefill_tp == decode_tp:
        return "" if prefill_tp == 1 else f"-tp{prefill_tp}"
    return f"-tp{prefill_tp}/{decode_tp}"


def natural_order(worker_id: str) -> list:
    """worker-2 before worker-10."""
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", worker_id))]


def split_cores(cores: list[int], n: int) -> list[list[int]]:
    """Contiguous near-equal groups if ``n <= len(cores)``, else core ``i % len(cores)`` alone (round-robin)."""
    if n <= len(cores):
        size, extra = divmod(len(cores), n)
        starts = [i * size + min(i, extra) for i in range(n + 1)]
        return [cores[starts[i]:starts[i + 1]] for i in range(n)]
    return [[cores[i % len(cores)]] for i in range(n)]


def plan_workers(mode: str, cores: list[int], *, workers: int = 1, prefill: int = 1, decode: int = 1,
                 encode: int = 1, tp: int = 1, prefill_tp: int = 1, decode_tp: int = 1,
                 encode_tp: int = 1) -> Placement:
    """``(role, worker_id, cores)`` per worker, encode, prefill, decode (rule: docs/serving.md), each on at
    least as many distinct cores as ranks. Raises ValueError: no cores, a count or size below 1, more ranks
    than cores, or an unknown mode."""
    if not cores:
        raise ValueError("no CPU cores to place workers on")
    if min(workers, prefill, decode, encode) < 1:
        raise ValueError("every worker count must be at least 1")
    if min(tp, prefill_tp, decode_tp, encode_tp) < 1:
        raise ValueError("every tensor-parallel size must be at least 1")
    groups = {"colocated": [("colocated", workers, tp)],
              "pd": [("prefill", prefill, prefill_tp), ("decode", decode, decode_tp)],
              "epd": [("encode", encode, encode_tp), ("prefill", prefill, prefill_tp), ("decode", decode, decode_tp)]}
    if mode not in groups:
        raise ValueError(f"unknown mode {mode!r}")
    for role, _, size in groups[mode]:
        if size > len(cores):
            raise ValueError(f"a {role} worker of {size} tensor-parallel ranks needs {size} cores, one a rank; "
                             f"there are {len(cores)} ({','.join(map(str, cores))})")
    if all(size == 1 for _, _, size in groups[mode]):
        return _by_halves(mode, cores, workers, prefill, decode, encode)
    if sum(n * size for _, n, size in groups[mode]) <= len(cores):
        return _by_ranks(groups[mode], cores)
    return _round_robin(groups[mode], cores)


def _by_halves(mode: str, cores: list[int], workers: int, prefill: int, decode: int, encode: int) -> Placement:
    if mode == "colocated":
        return [("colocated", f"colocated-{i}", c) for i, c in enumerate(split_cores(cores, workers))]
    half = max(1, len(cores) // 2)
    first, plan = cores[:half], []
    if mode == "epd":
        split = max(1, len(first) // 2)
        plan = [("encode", f"encode-{i}", c) for i, c in enumerate(split_cores(first[:split], encode))]
        first = first[split:] or first
    return (plan + [("prefill", f"prefill-{i}", c) for i, c in enumerate(split_cores(first, prefill))]
            + [("decode", f"decode-{i}", c) for i, c in enumerate(split_cores(cores[half:] or cores, decode))])


def _by_ranks(groups: list[tuple[str, int, int]], cores: list[int]) -> Placement:
    """Cores for every rank: :func:`_by_halves`' groups, each bound moved the least to hold n x S cores."""
    need = [n * size for _, n, size in groups]
    bounds = [0, len(cores)]
    if len(groups) > 1:  # pd, epd: the decode workers' group starts near the middle
        head = _clamp(len(cores) // 2, sum(need[:-1]), len(cores) - need[-1])
        bounds = [0, head, len(cores)]
        if len(groups) == 3:  # epd: encode, then prefill, in the first part
            bounds.insert(1, _clamp(max(1, head // 2), need[0], head - need[1]))
    plan = []
    for (role, n, _), lo, hi in zip(groups, bounds, bounds[1:]):
        plan += [(role, f"{role}-{i}", c) for i, c in enumerate(split_cores(cores[lo:hi], n))]
    return plan


def _round_robin(groups: list[tuple[str, int, int]], cores: list[int]) -> Placement:
    """Fewer cores than ranks: each worker takes the next S cores in turn, wrapping around."""
    plan, taken = [], 0
    for role, n, size in groups:
        for i in range(n):
            mine = sorted({(taken + k) % len(cores) for k in range(size)})
            plan.append((role, f"{role}-{i}", [cores[k] for k in mine]))
            taken += size
    return plan


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(value, hi))
