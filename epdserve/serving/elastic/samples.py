"""The elastic policies' input, one :class:`Sample` of the router's signals, and its JSON form
(a trace's ``elastic_sample`` line), read back exactly or refused naming the key and value."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from epdserve.serving.deployment import ENGINE_ROLES


@dataclass(frozen=True)
class WorkerSignal:
    """One engine worker at one sample (format: docs/comparing.md)."""
    worker_id: str
    role: str
    switching: bool     # asked, not yet announced
    num_running: int
    num_waiting: int
    outstanding: int    # requests the router sent it, not finished
    kv_usage: float     # blocks in use / total, 0..1


@dataclass(frozen=True)
class Sample:
    """The router's signals; the tuples hold what happened since the previous sample."""
    t: float                                # s, the router's monotonic clock
    workers: tuple[WorkerSignal, ...]
    arrivals: tuple[tuple[int, int], ...]   # (prompt tokens, max_tokens)
    ttfts_ms: tuple[float, ...]
    prefill_queue_ms: tuple[float, ...]     # router + worker queue, per first token
    itls_ms: tuple[float, ...]              # gaps between a request's outputs at the router
    prefill_tokens: tuple[int, ...] = ()    # computed per first token (prompt - cache hit); () in older traces

    def as_json(self) -> dict:
        return {"t": self.t, "workers": [asdict(w) for w in self.workers],
                "arrivals": [list(a) for a in self.arrivals], "ttfts_ms": list(self.ttfts_ms),
                "prefill_queue_ms": list(self.prefill_queue_ms), "itls_ms": list(self.itls_ms),
                "prefill_tokens": list(self.prefill_tokens)}

    @classmethod
    def from_json(cls, obj: dict) -> Sample:
        """Raises ValueError naming the key and value: a missing (but ``prefill_tokens``) or unknown
        key, a wrong type, a negative or non-finite number, an unknown role, a kv_usage over 1."""
        _check_keys("sample", {"prefill_tokens": [], **obj} if isinstance(obj, dict) else obj,
                    {f.name for f in fields(cls)})
        workers, arrivals = obj["workers"], obj["arrivals"]
        if not isinstance(workers, list) or not isinstance(arrivals, list):
            raise ValueError("sample: 'workers' and 'arrivals' must be lists")
        return cls(t=finite_number("sample t", obj["t"], minimum=-math.inf),
                   workers=tuple(_worker_from_json(w) for w in workers),
                   arrivals=tuple(_arrival_from_json(a) for a in arrivals),
                   ttfts_ms=_numbers("ttfts_ms", obj["ttfts_ms"]),
                   prefill_queue_ms=_numbers("prefill_queue_ms", obj["prefill_queue_ms"]),
                   itls_ms=_numbers("itls_ms", obj["itls_ms"]),
                   prefill_tokens=_counts("prefill_tokens", obj.get("prefill_tokens", [])))


def _check_keys(what: str, obj, expected: set[str]) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    wrong = [f"{kind} keys {sorted(keys)}" for kind, keys in
             (("missing", expected - obj.keys()), ("unknown", obj.keys() - expected)) if keys]
    if wrong:
        raise ValueError(f"{what}: {', '.join(wrong)}")


def finite_number(what: str, value, minimum: float = 0.0) -> float:
    """Raises ValueError naming ``what`` unless ``value`` is a finite number >= ``minimum``, not a bool."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < minimum):
        bound = f" >= {minimum:g}" if minimum > -math.inf else ""
        raise ValueError(f"{what}: expected a finite number{bound}, got {value!r}")
    return float(value)


def _count(what: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: expected an integer >= 0, got {value!r}")
    return value


def _numbers(what: str, values) -> tuple[float, ...]:
    if not isinstance(values, list):
        raise ValueError(f"sample: {what!r} must be a list, got {values!r}")
    return tuple(finite_number(what, v) for v in values)


def _counts(what: str, values) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise ValueError(f"sample: {what!r} must be a list, got {values!r}")
    return tuple(_count(what, v) for v in values)


def _worker_from_json(obj) -> WorkerSignal:
    _check_keys("worker", obj, {f.name for f in fields(WorkerSignal)})
    wid, role, switching = obj["worker_id"], obj["role"], obj["switching"]
    if not isinstance(wid, str) or not wid:
        raise ValueError(f"worker: worker_id must be a non-empty string, got {wid!r}")
    if role not in ENGINE_ROLES:
        raise ValueError(f"worker {wid}: role {role!r} is not one of {', '.join(ENGINE_ROLES)}")
    if not isinstance(switching, bool):
        raise ValueError(f"worker {wid}: switching must be true or false, got {switching!r}")
    kv = finite_number(f"worker {wid} kv_usage", obj["kv_usage"])
    if kv > 1.0:
        raise ValueError(f"worker {wid} kv_usage: expected 0..1, got {kv!r}")
    return WorkerSignal(wid, role, switching,
                        *(_count(f"worker {wid} {k}", obj[k])
                          for k in ("num_running", "num_waiting", "outstanding")), kv)


def _arrival_from_json(obj) -> tuple[int, int]:
    if not isinstance(obj, list) or len(obj) != 2:
        raise ValueError(f"arrival: expected [prompt tokens, max_tokens], got {obj!r}")
    return _count("arrival prompt tokens", obj[0]), _count("arrival max_tokens", obj[1])
