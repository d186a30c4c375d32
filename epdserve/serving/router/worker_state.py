"""What the router knows of one worker (:class:`WorkerState`) and its ``/health`` entry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    worker_id: str
    role: str
    addr: str
    model: str
    kv_layout: dict = field(default_factory=dict)
    cores: list[int] = field(default_factory=list)
    blocks_total: int = 0
    blocks_in_use: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    last_seen: float = field(default_factory=time.monotonic)  # time.monotonic() of its last message
    dead: str | None = None  # why it is considered gone
    outstanding: dict[str, int] = field(default_factory=dict)  # request id -> prompt + max_tokens
    exports: set[str] = field(default_factory=set)  # until their KV is released
    incarnation: str = ""
    heard: float = 0.0  # the read clock at its last message
    reset_sent: float = -float("inf")  # time.monotonic() of the last Reset
    node_id: str = ""  # the Ray node id, or the host name
    node_ip: str = ""
    resources: dict[str, float] = field(default_factory=dict)  # what its Ray actor holds
    pid: int = 0
    weight_format: str = ""
    engine: dict = field(default_factory=dict)
    tensor_parallel_size: int = 1
    tuned: dict[str, dict] = field(default_factory=dict)
    announced: str = ""  # last announced (Hello, RoleSwitched); ``role`` is what routes
    switch_id: str | None = None  # a SetRole it has not answered yet
    switch_reason: str | None = None
    retiring: bool = False  # elastic: no new work, it finishes what it holds
    stats_seen: float = 0.0  # time.monotonic()

    def as_json(self, now: float) -> dict:
        """Its /health entry (``now``: ``time.monotonic()``)."""
        return {"worker_id": self.worker_id, "role": self.role, "announced_role": self.announced,
                "switching": self.switch_id is not None, "addr": self.addr, "cores": self.cores,
                "state": "down" if self.dead else "retiring" if self.retiring else "up", "reason": self.dead,
                "kv_dtype": self.kv_layout.get("dtype"), "weight_format": self.weight_format,
                "tensor_parallel_size": self.tensor_parallel_size, "tuned": self.tuned, "engine": self.engine,
                "blocks_in_use": self.blocks_in_use, "blocks_total": self.blocks_total,
                "num_running": self.num_running, "num_waiting": self.num_waiting,
                "outstanding": len(self.outstanding), "outstanding_tokens": sum(self.outstanding.values()),
                "last_seen_s_ago": round(now - self.last_seen, 3),
                "node_id": self.node_id, "node_ip": self.node_ip, "resources": self.resources,
                "pid": self.pid}
