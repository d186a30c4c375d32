"""Stage timings and the per-request trace record: the one definition of every stage.

A worker measures what it did for a request into a :class:`StageTimings` and sends it with
its last ``Output`` (or ``Encoded``); the router adds its own stamps and the workers'
timings into one :class:`RequestTrace` per request (per choice of an ``n > 1`` request),
which is the server trace file's JSON line (:meth:`RequestTrace.as_json`), feeds
``/metrics``, and is what ``bench``'s breakdown and ``plan``'s calibration read back
(:meth:`RequestTrace.from_json`). All times are milliseconds (``*_ms``), sizes bytes,
``*_tokens`` token counts.

Stages, in the order a request meets them. TTFT = ``router_queue_ms`` + [image stages] +
the first worker's queue + ``prefill_ms`` [+ ``kv_export_ms``] + ``ttft_hop_ms``:

* ``router_queue_ms``: HTTP arrival at the router to dispatch (tokenization, validation,
  picking a worker).
* With images: ``encode_queue_ms`` (arrival at the worker that encodes to encode start),
  ``encode_ms`` (in EPD: of the encode worker that answered last, the critical path),
  ``embedding_transfer_ms`` (derived: the encode worker writing its frame,
  ``embedding_export_ms``, plus the prefill worker reading them, ``embedding_fetch_ms``;
  0 when the prefilling worker encodes) and ``embedding_bytes`` (summed over encode workers).
* The first worker's queue: arrival at the worker (stamped by its receiving thread) to
  first scheduled, less a KV fetch made in between. A worker reports ``queue_ms``; the
  trace keeps it by role: ``colocated_queue_ms``, ``prefill_queue_ms``, ``decode_queue_ms``;
  ``queue_ms`` (derived) is the colocated worker's, or in PD/EPD the sum of the two.
* ``prefill_ms``: first scheduled to first token on the worker that prefilled.
* ``kv_export_ms``: the prefill worker copying the prompt's KV out (before it sends the
  first token); ``kv_bytes``: the bytes it wrote (0 in colocated); ``kv_layer_copy_ms``: with
  the layer pipeline, the per-layer copies made inside the prefill step.
* ``ttft_hop_ms`` (derived): the rest of TTFT, dispatch to the first token back at the router
  less the stages above (ZeroMQ and event-loop hops).

A PD hand-off's gap, the first token at the router to the second (``handoff_gap_ms``) =
``router_hop_ms`` + ``kv_fetch_ms`` + ``decode_queue_ms`` + ``kv_import_ms`` +
``first_decode_ms`` + ``handoff_hop_ms``:

* ``router_hop_ms``: first token at the router to the request handed to the send to the
  decode worker (the router writes the first token to the client meanwhile; encoding and
  sending it are hops).
* ``kv_fetch_ms`` (shm map or TCP, before the request is queued; ``kv_tcp`` 1.0 when over
  TCP), ``kv_import_ms`` (into the decode worker's cache, within its first step) and
  ``kv_transfer_ms`` (derived): export + router hop + fetch + import (0 in colocated).
* ``first_decode_ms`` (PD hand-off): the decode worker's first step for the request, the
  one that admits it into the running batch, from first scheduled to its first token
  there (the request's second) sampled, less its ``kv_import_ms``: the other requests'
  imports in that step, freeing the imported KV's source (a /dev/shm mapping or a TCP
  buffer), and the step's forward pass and sampling, batched with the running requests.
* ``handoff_gap_ms`` (PD hand-off): the first token at the router to the second token at
  the router (the router's view of the client's token 1 -> 2 gap); ``handoff_hop_ms``
  (derived): what of it no stage covers, ``handoff_gap_ms`` less ``router_hop_ms``,
  ``kv_fetch_ms``, ``decode_queue_ms``, ``kv_import_ms`` and ``first_decode_ms``: the
  ZeroMQ and event-loop hops of the ``AddRequest`` to the decode worker and of the second
  token back to the router.
* ``decode_ms``: first token to last token on the worker that decoded; for an imported
  request from first scheduled (it includes ``kv_import_ms`` and ``first_decode_ms``).
* ``ttft_ms``, ``e2e_ms``: HTTP arrival to the first / last token at the router.

Not a time: ``recomputed_tokens``, the tokens whose K/V a worker computed again after it
preempted the request (recompute: the prompt, imported or not, and the tokens generated so
far, less the blocks still found in its prefix cache), summed over the request's workers;
0 when never preempted. They are the tokens a worker's steps computed for the request
(its ``iteration_tokens_total``) beyond those it needed.

``finish_reason``: vLLM's, as ``/metrics`` counts them in ``request_success_total``: "stop",
"length", "error" (a worker failed it, or it went down or silent; ``error`` says why) or
"abort" (the client went away before the end).

``path`` is "colocated", "disaggregated" (prefill worker, then decode worker) or "local" (a
PD request under ``--local-prefill-threshold``, prefilled by the decode worker itself).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_serializer

PATHS = ("colocated", "disaggregated", "local")
# The worker stage whose queue is the first of a request, by path.
FIRST_QUEUE = {"colocated": "colocated_queue_ms", "disaggregated": "prefill_queue_ms", "local": "decode_queue_ms"}


class WorkerStages(BaseModel):
    """The stages a worker measures for a request besides its queue (ms, bytes); None: not
    measured there. See the module docstring for each one's definition."""

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
        """The stages that were measured, as ``{name: value}``."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


class StageTimings(WorkerStages):
    """What one worker measured for one request: its queue and the :class:`WorkerStages`.

    Carried by :class:`~epdserve.serving.protocol.Output` and ``Encoded``; a stage not
    defined here is refused.
    """

    model_config = ConfigDict(extra="forbid")

    queue_ms: float | None = None

    @model_serializer
    def _measured_only(self) -> dict[str, float]:
        # Every streamed Output carries timings, almost always none: on the wire they are
        # {} rather than a null per stage, which doubled the size and decode time of a token's frame.
        return self.measured()

    def update(self, other: StageTimings) -> None:
        """Take every stage ``other`` measured (a later measurement replaces an earlier one)."""
        for key, value in other.measured().items():
            setattr(self, key, value)


class RequestTrace(WorkerStages):
    """One request's trip (one JSON line of the server trace file).

    Stored fields are what the router and the workers measured (the workers' queues by
    role, their other stages as :class:`WorkerStages`); ``queue_ms``,
    ``kv_transfer_ms``, ``embedding_transfer_ms``, ``ttft_hop_ms`` and ``handoff_hop_ms``
    are derived
    (properties), as the module docstring defines them. Unknown keys of a JSON line are
    ignored, so older and newer trace files both read.
    """

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
    # Where they ran (their Hello's node id: the Ray node, else the host name): a PD
    # hand-off between two nodes went over TCP (kv_tcp), within one by shared memory.
    prefill_node: str | None = None
    decode_node: str | None = None
    # How the first worker (colocated or prefill) was picked: the --routing policy, and with
    # prefix-aware its reason and the prompt tokens believed cached there (to set beside
    # cached_tokens, what the worker found).
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

    def add(self, role: str, timings: StageTimings) -> None:
        """Take a worker's measurements: its queue under ``<role>_queue_ms``, the rest by
        name (a later one replaces an earlier one), except ``embedding_bytes`` of encode
        workers and ``recomputed_tokens``, which add up (each worker sends its own)."""
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
        """Worker queues: the colocated worker's, or in PD/EPD prefill + decode queue."""
        if self.mode == "colocated":
            return self.colocated_queue_ms
        queues = [q for q in (self.prefill_queue_ms, self.decode_queue_ms) if q is not None]
        return sum(queues) if queues else None

    @property
    def kv_transfer_ms(self) -> float | None:
        """A PD hand-off: export + router hop + fetch + import; 0 in colocated; None when a
        PD request had no hand-off."""
        if self.mode == "colocated":
            return 0.0
        if self.kv_export_ms is None or self.kv_import_ms is None:
            return None
        return self.kv_export_ms + (self.router_hop_ms or 0.0) + (self.kv_fetch_ms or 0.0) + self.kv_import_ms

    @property
    def embedding_transfer_ms(self) -> float | None:
        """Embedding export + fetch (EPD); 0 for a request with images encoded where it is
        prefilled; None without images."""
        if not self.num_images:
            return None
        return (self.embedding_export_ms or 0.0) + (self.embedding_fetch_ms or 0.0)

    @property
    def ttft_hop_ms(self) -> float | None:
        """TTFT less every stage before the first token that a process measured: the hops
        between processes and event loops (ms); None when a stage it needs is missing."""
        first_queue = getattr(self, FIRST_QUEUE.get(self.path, "colocated_queue_ms"))
        if None in (self.ttft_ms, self.router_queue_ms, first_queue, self.prefill_ms):
            return None
        images = (self.encode_queue_ms or 0.0) + (self.encode_ms or 0.0) + (self.embedding_transfer_ms or 0.0)
        return round(self.ttft_ms - self.router_queue_ms - first_queue - images - self.prefill_ms
                     - (self.kv_export_ms or 0.0), 3)

    @property
    def handoff_hop_ms(self) -> float | None:
        """The router's token 1 -> 2 gap of a hand-off (``handoff_gap_ms``) less every stage
        in it that a process measured: the hops of the ``AddRequest`` to the decode worker
        and of the second token back (ms); None without a hand-off or a stage it needs."""
        if None in (self.handoff_gap_ms, self.kv_import_ms, self.first_decode_ms):
            return None
        return round(self.handoff_gap_ms - (self.router_hop_ms or 0.0) - (self.kv_fetch_ms or 0.0)
                     - (self.decode_queue_ms or 0.0) - self.kv_import_ms - self.first_decode_ms, 3)

    def as_json(self) -> dict:
        """The trace file's JSON object: identity and router stamps always (None where not
        reached), every measured stage, and the derived stages that apply."""
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
        """Read one trace line back (this version's or an older one's: a colocated line's
        ``queue_ms`` is its worker's queue; a line without ``path`` is "disaggregated" in
        PD/EPD, else "colocated").

        Raises:
            pydantic.ValidationError: a line that is not a trace record.
        """
        obj = dict(obj)
        if obj.get("path") not in PATHS:
            obj["path"] = "disaggregated" if obj.get("mode") in ("pd", "epd") else "colocated"
        if obj.get("mode", "colocated") == "colocated" and "colocated_queue_ms" not in obj:
            obj["colocated_queue_ms"] = obj.get("queue_ms")
        return cls.model_validate(obj)
