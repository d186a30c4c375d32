# TEMPORARY placeholder (replaced by h-policy's module at merge)
from __future__ import annotations
from dataclasses import dataclass, field, asdict
from typing import Sequence
import math

@dataclass(frozen=True)
class WorkerSignal:
    worker_id: str
    role: str
    switching: bool
    num_running: int
    num_waiting: int
    outstanding: int
    kv_usage: float

@dataclass(frozen=True)
class Sample:
    t: float
    workers: tuple
    arrivals: tuple
    ttfts_ms: tuple
    prefill_queue_ms: tuple
    itls_ms: tuple
    def as_json(self):
        return asdict(self)

@dataclass(frozen=True)
class PolicyConfig:
    slo_ttft_ms: float
    slo_tpot_ms: float
    window_s: float = 20.0
    min_dwell_s: float = 30.0

@dataclass(frozen=True)
class PolicyState:
    last_switch_t: float = -math.inf

@dataclass(frozen=True)
class Decision:
    t: float
    roles: dict | None
    action: str
    reason: str
    signals: dict

def decide(samples: Sequence[Sample], state: PolicyState, config: PolicyConfig):
    return Decision(samples[-1].t, None, "hold", "placeholder", {}), state
