"""Stage timings (a worker's, per request) and the per-request trace record (a trace-file JSON line); what each
stage measures: docs/architecture.md, "The trace record". Times ms, sizes bytes, ``*_tokens`` counts."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_serializer

PATHS = ("colocated", "disaggregated", "local")
# The worker stage whose queue is the first of a request, by path.
FIRST_QUEUE = {"colocated": "colocated_queue_ms", "disaggregated": "prefill_queue_ms", "local": "decode_queue_ms"}


class WorkerStages(BaseModel):
    """None: not measured there."""

    prefill_ms: float | None = None
    decode_ms: float | None = None
    kv_export_ms: float | None = None
    kv_bytes: float | None = None
    kv_layer_copy_ms: float | None = None
    kv_fetch_ms: float | None = None
    kv_tcp: float | None = None
    kv_import_ms: float | None = None
    first_decode_ms: float | None = None
    recomputed_tokens: int | None = None
    encode_queue_ms: float | None = None
    encode_ms: float | None = None
    embedding_export_ms: float | None = None
    embedding_fetch_ms: float | None = None
    embedding_bytes: float | None = None

    def measured(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


class StageTimings(WorkerStages):
    """A worker's measurements, carried by ``Output`` and ``Encoded``; an unknown stage is refused."""

    model_config = ConfigDict(extra="forbid")

    queue_ms: float | None = None

    @model_serializer
    def _measured_only(self) -> dict[str, float]:
        # On the wire {} rather than a null per stage: nulls doubled a token frame's size and decode time.
        return self.measured()

    def update(self, other: StageTimings) -> None:
        for key, value in other.measured().items():
            setattr(self, key, value)


class RequestTrace(WorkerStages):
    """One trace-file JSON line; properties are the derived stages; unknown keys ignored (old and new files read)."""

    model_config = ConfigDict(extra="ignore")

    request_id: str
    mode: str = "colocated"
    path: str = "colocated"
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # of prompt_tokens, found in the first worker's prefix cache
    output_tokens: int = 0
    max_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    worker: str | None = None  # colocated: the worker that served it
    prefill_worker: str | None = None
    decode_worker: str | None = None
    # Node ids (the Ray node, else the host name): a PD hand-off across nodes went over TCP.
    prefill_node: str | None = None
    decode_node: str | None = None
    # How the first worker was picked (--routing; prefix-aware: its reason and the tokens believed cached).
    routing: str | None = None
    routing_reason: str | None = None
    routing_believed_tokens: int | None = None
    encode_workers: list[str] | None = None
    num_images: int | None = None
    router_queue_ms: float | None = None
    router_hop_ms: float | None = None
    handoff_gap_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    colocated_queue_ms: float | None = None
    prefill_queue_ms: float | None = None
    decode_queue_ms: float | None = None
    # Each move to a live worker after its worker died mid-stream: {"from", "to", "recomputed_tokens"}.
    migrations: list[dict] | None = None

    def add(self, role: str, timings: StageTimings) -> None:
        """Queue as ``<role>_queue_ms``; ``embedding_bytes`` of encode workers and ``recomputed_tokens`` add up."""
        for key, value in timings.measured().items():
            if key == "queue_ms":
                key = f"{role}_queue_ms"
            elif key == "embedding_bytes" and role == "encode":
                value += self.embedding_bytes or 0.0
            elif key == "recomputed_tokens":
                value += self.recomputed_tokens or 0
            setattr(self, key, value)

    @property
    def queue_ms(self) -> float | None:
        if self.mode == "colocated":
            return self.colocated_queue_ms
        queues = [q for q in (self.prefill_queue_ms, self.decode_queue_ms) if q is not None]
        return sum(queues) if queues else None

    @property
    def kv_transfer_ms(self) -> float | None:
        """0 in colocated; None for a PD request without a hand-off."""
        if self.mode == "colocated":
            return 0.0
        if self.kv_export_ms is None or self.kv_import_ms is None:
            return None
        return self.kv_export_ms + (self.router_hop_ms or 0.0) + (self.kv_fetch_ms or 0.0) + self.kv_import_ms

    @property
    def embedding_transfer_ms(self) -> float | None:
        """0 if encoded where prefilled; None without images."""
        if not self.num_images:
            return None
        return (self.embedding_export_ms or 0.0) + (self.embedding_fetch_ms or 0.0)

    @property
    def ttft_hop_ms(self) -> float | None:
        """None when a stage it needs is missing."""
        first_queue = getattr(self, FIRST_QUEUE.get(self.path, "colocated_queue_ms"))
        if None in (self.ttft_ms, self.router_queue_ms, first_queue, self.prefill_ms):
            return None
        images = (self.encode_queue_ms or 0.0) + (self.encode_ms or 0.0) + (self.embedding_transfer_ms or 0.0)
        return round(self.ttft_ms - self.router_queue_ms - first_queue - images - self.prefill_ms
                     - (self.kv_export_ms or 0.0), 3)

    @property
    def handoff_hop_ms(self) -> float | None:
        """None without a hand-off or a stage it needs."""
        if None in (self.handoff_gap_ms, self.kv_import_ms, self.first_decode_ms):
            return None
        return round(self.handoff_gap_ms - (self.router_hop_ms or 0.0) - (self.kv_fetch_ms or 0.0)
                     - (self.decode_queue_ms or 0.0) - self.kv_import_ms - self.first_decode_ms, 3)

    def as_json(self) -> dict:
        """Identity and router stamps always (None where not reached), measured stages, applicable derived ones."""
        always = ("request_id", "mode", "path", "prompt_tokens", "output_tokens", "max_tokens", "finish_reason",
                  "error", "prefill_worker", "decode_worker", "router_queue_ms", "ttft_ms", "e2e_ms")
        rec = {k: getattr(self, k) for k in always}
        rec.update({k: v for k, v in self.__dict__.items() if v is not None and k != "colocated_queue_ms"})
        if self.mode == "colocated":
            rec["worker"] = self.worker
            rec["kv_bytes"] = self.kv_bytes or 0.0  # no hand-off: zero, as bench expects
        if self.num_images:
            rec["embedding_bytes"] = self.embedding_bytes or 0.0
        derived = {"queue_ms": self.queue_ms, "kv_transfer_ms": self.kv_transfer_ms,
                   "embedding_transfer_ms": self.embedding_transfer_ms, "ttft_hop_ms": self.ttft_hop_ms,
                   "handoff_hop_ms": self.handoff_hop_ms}
        rec.update({k: v for k, v in derived.items() if v is not None})
        return rec

    @classmethod
    def from_json(cls, obj: dict) -> RequestTrace:
        """Also older lines (colocated ``queue_ms`` is the worker's; no ``path``: by ``mode``). Raises ValidationError."""
        obj = dict(obj)
        if obj.get("path") not in PATHS:
            obj["path"] = "disaggregated" if obj.get("mode") in ("pd", "epd") else "colocated"
        if obj.get("mode", "colocated") == "colocated" and "colocated_queue_ms" not in obj:
            obj["colocated_queue_ms"] = obj.get("queue_ms")
        return cls.model_validate(obj)
