"""Typed messages between the router and its workers.

Every message is one ZeroMQ frame holding a msgpack map with a ``type`` field, sealed by
:mod:`epdserve.serving.auth` (an HMAC-SHA256 tag under a key derived from the
deployment's token, checked before the frame is parsed; none without a token); it is
validated by pydantic on receipt, so a frame that is not our wire format (a pickle,
garbage, a wrong field) raises :class:`ProtocolError` and is never deserialised into
code. Tensors never travel in these frames: KV blocks go through ``epdserve.transfer``
and only their descriptor (a small map) rides here.

Sockets (one direction each, so neither side blocks on the other):

* the router binds one PULL socket (``events``); every worker connects a PUSH to it and
  sends :class:`Hello` once, then :class:`Stats`, :class:`Output` and :class:`Error`
  (a second PUSH of its heartbeat thread sends :class:`Heartbeat`);
* every worker binds one PULL socket (``cmd``); the router connects a PUSH to it on
  ``Hello`` and sends :class:`AddRequest`, :class:`Abort`, :class:`ReleaseKV`,
  :class:`Shutdown`, :class:`Reset`, :class:`SetRole` (elastic), or only :class:`Refused`
  if it turns the worker away (a worker answers SetRole with :class:`RoleSwitched` once
  it has drained);
  an encode worker gets :class:`Encode` instead of :class:`AddRequest` and answers
  :class:`Encoded`.

A worker process draws a random ``incarnation`` at start and sends it in its Hello and
heartbeats: it tells the process that holds a worker id from another one claiming it
(see ``Registry.on_hello`` in ``epdserve.serving.router.registry``), and commands are sealed for it alone.

Times in ``timings`` are durations in milliseconds (``*_ms``) or byte counts
(``*_bytes``) so that they stay meaningful across hosts.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from epdserve.engine.request import SamplingParams
# KVDescriptor is re-exported (noqa: F401): it is part of this wire format, defined with the transfer it describes.
from epdserve.transfer.descriptor import KVDescriptor  # noqa: F401
from epdserve.trace import StageTimings
from epdserve.serving.deployment import EngineRole, Role


# The version of these messages. A router refuses a worker of another version (see
# ``handshake.refusal``), which would otherwise send frames it cannot read. 1: before the
# field existed; 2: typed stage timings (``epdserve.trace.StageTimings``); 3: prompt
# logprobs (``SamplingParams.prompt_logprobs``, ``Output.prompt_logprobs``) and ``Stats``
# carrying the engine's steps (``num_steps``, ``last_step_tokens``); 4: KV descriptors of
# kind ``cuda_ipc`` with their ``ipc`` handle bytes (a GPU prefill worker's pool); 5: live
# role switches (:class:`SetRole`, :class:`RoleSwitched`); 6: stage timings
# ``first_decode_ms`` and ``recomputed_tokens``; 7: ``Hello.tuned`` (measured choices).
PROTOCOL_VERSION = 7


# A count a worker reports (blocks, requests, tokens): what the router and the Prometheus
# counters take, never negative (a counter cannot go down) and within int64.
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]


class ProtocolError(ValueError):
    """A frame that is not a valid epdserve message."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageRef(_Msg):
    """One image of a request: ``hash`` (sha256 hex of its file bytes), ``tokens`` (its
    ``<image>`` tokens in the prompt, = embedding rows) and ``data`` (the file bytes; only
    to a worker that encodes it)."""

    hash: str
    tokens: int = Field(ge=1)
    data: bytes | None = None


class EmbeddingRef(_Msg):
    """Embeddings of some of a request's images, encoded by an encode worker: ``images``
    (indices into ``AddRequest.images``, ascending) and the frame holding them
    (``epdserve.transfer.embedding``), described as a staged KV frame is: ``kind`` "shm"."""

    images: list[int]
    frame: "KVDescriptor"


class TunedChoice(_Msg):
    """A choice a worker's engine measured on its machine (``model/tuning.py``): ``value``
    (the cut-over's rows, ...) and ``source``: read from the machine's cache, measured now,
    or measured now on a busy machine and not kept."""

    value: int | str
    source: Literal["cache", "measured", "disturbed"]


class Hello(_Msg):
    """A worker's first message (and its answer to :class:`Reset`). ``fingerprint``
    identifies its weights and ``auth`` is the HMAC of ``worker_id`` under the deployment's
    token (see ``epdserve.serving.handshake``); ``cores`` are the CPU cores it is pinned
    to; ``incarnation``: the random id of this worker process. ``node_id``, ``node_ip``
    and ``resources`` say where it runs: on Ray its node's id and IP and the resources
    its actor holds (``{"CPU": 1.0, "prefill_node": 1.0}``); under the local launcher
    (or by hand) the host name, "" and {}; ``pid`` its process on that node;
    ``weight_format`` the ``--weight-format`` its engine holds (``model/linear.py``: ``q4_1``,
    ``f32``, ``q4_1+f32``, ...; "" for an encode worker or an older worker);
    ``tensor_parallel_size`` its ``--tensor-parallel-size``: the ranks (processes) its engine
    runs on (1 for an older worker); ``tuned`` its engine's measured choices by name
    (``kernel_rows``: the block kernel / BLAS cut-over; none without GGUF blocks)."""

    type: Literal["hello"] = "hello"
    worker_id: str
    role: Role
    addr: str
    model: str
    fingerprint: str
    kv_layout: dict
    blocks_total: Count
    cores: list[int] = []
    auth: str = ""
    incarnation: str = Field(min_length=8, max_length=64)
    protocol: int = 1  # PROTOCOL_VERSION of the worker's code; absent (1) from older workers
    node_id: str = Field(default="", max_length=128)
    node_ip: str = Field(default="", max_length=64)
    resources: dict[str, float] = Field(default_factory=dict, max_length=64)
    pid: int = Field(default=0, ge=0)  # its process id on its node (0: not given)
    weight_format: str = Field(default="", max_length=32)
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    tuned: dict[str, TunedChoice] = Field(default_factory=dict, max_length=16)


class Heartbeat(_Msg):
    """Sent every 0.5 s (``worker.HEARTBEAT_INTERVAL_S``) by a worker thread of its own, even while the
    engine is busy in a long step, so that silence means the worker is gone."""

    type: Literal["heartbeat"] = "heartbeat"
    worker_id: str
    incarnation: str


class Stats(_Msg):
    """A worker's block and queue counts (``LLMEngine.stats()``); the prefix-cache counters
    are cumulative tokens: prompt tokens looked up, and found cached (vLLM's meaning). A
    worker reports after every step, so each new ``num_steps`` comes with its step's tokens."""

    type: Literal["stats"] = "stats"
    worker_id: str
    blocks_total: Count
    blocks_in_use: Count
    num_running: Count
    num_waiting: Count
    num_preemptions: Count
    prefix_cache_queries: Count = 0
    prefix_cache_hits: Count = 0
    mm_cache_queries: Count = 0
    mm_cache_hits: Count = 0
    num_steps: Count = 0  # forward passes since the worker started
    last_step_tokens: Count = 0  # tokens the last one computed


class Output(_Msg):
    """New tokens of one request from one engine step.

    A prefill worker sends exactly one: the first token, ``kv`` set unless the request
    already finished. ``finish_reason`` is "stop" (EOS / stop token), "length"
    (``max_tokens``) or "abort"; ``timings`` are filled on the last output of a worker.
    ``num_cached_tokens``: prompt tokens this worker found in its prefix cache.
    ``logprobs`` (if the request asked): per token of ``token_ids``, ``[its logprob,
    [[token id, logprob], ...] of the top alternatives]`` (see ``engine.sampler``).
    ``prompt_logprobs`` (on the first token's output of the worker that prefilled a request
    asking ``SamplingParams.prompt_logprobs``): per prompt token but the first, ``[its
    logprob, its rank, [[token id, logprob], ...] of the top alternatives]`` (see
    ``engine.prompt_logprobs``; at most ``MAX_PROMPT_LOGPROB_ENTRIES`` entries).
    """

    type: Literal["output"] = "output"
    worker_id: str
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    kv: KVDescriptor | None = None
    timings: StageTimings = Field(default_factory=StageTimings)
    num_cached_tokens: Count = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None


class Error(_Msg):
    """A request that a worker could not serve: ``status`` 400 when the request itself is
    wrong (validation, a bad image), 500 when the worker failed it (an engine step, a KV
    hand-off); ``message`` is for the client and names no internals."""

    type: Literal["error"] = "error"
    worker_id: str
    request_id: str
    message: str
    status: int = Field(400, ge=400, le=599)


class AddRequest(_Msg):
    """Start a request. For a decode worker, ``kv`` and ``first_token`` are set.
    ``images``: the prompt's images in order; a worker that prefills gets either their
    ``data`` (it encodes them itself) or their ``embeddings`` from encode workers."""

    type: Literal["add"] = "add"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv: KVDescriptor | None = None
    first_token: int | None = None
    images: list[ImageRef] = []
    embeddings: list[EmbeddingRef] = []


class Encode(_Msg):
    """Encode ``images`` (with ``data``) of request ``request_id`` into one embedding frame."""

    type: Literal["encode"] = "encode"
    request_id: str
    images: list[ImageRef]


class Encoded(_Msg):
    """An encode worker's answer to :class:`Encode`: the frame with the images'
    embeddings, held until ``ReleaseKV`` (or its TTL); ``timings``: ``encode_queue_ms``,
    ``encode_ms``, ``embedding_export_ms``, ``embedding_bytes``."""

    type: Literal["encoded"] = "encoded"
    worker_id: str
    request_id: str
    frame: KVDescriptor
    timings: StageTimings = Field(default_factory=StageTimings)


class Abort(_Msg):
    type: Literal["abort"] = "abort"
    request_id: str


class ReleaseKV(_Msg):
    """Tell a prefill worker that an exported KV cache will not be imported (an encode
    worker: that the request's embedding frame will not be read, or its encoding is moot)."""

    type: Literal["release_kv"] = "release_kv"
    request_id: str


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"


class Refused(_Msg):
    """The router will not use this worker (incompatible model or KV layout, its id held by
    a live worker); the worker exits with status 2. ``incarnation``: the Hello's; a worker
    process of another incarnation ignores it (the address a Hello names may be another's)."""

    type: Literal["refused"] = "refused"
    reason: str
    incarnation: str = ""


class Reset(_Msg):
    """The router took this worker for down (it was silent) and hears it again: it has failed
    or moved elsewhere every request the worker held. The worker aborts them all, releases
    every export, and says Hello again (same ``incarnation``, which this must name)."""

    type: Literal["reset"] = "reset"
    incarnation: str


class SetRole(_Msg):
    """Change this engine worker's role to ``role`` (``serve --elastic``). It takes the new
    role's work at once (the router routes by it from the moment it sends this), finishes
    the work it holds of the old role (its queued and running requests, its fetches, its
    exports until released) and then answers :class:`RoleSwitched` with ``switch_id``."""

    type: Literal["set_role"] = "set_role"
    role: EngineRole
    switch_id: str = Field(max_length=64)


class RoleSwitched(_Msg):
    """A worker has drained the work of its ``previous`` role and now holds only ``role``'s;
    ``drain_ms``: from its receipt of :class:`SetRole` ``switch_id`` to now."""

    type: Literal["role_switched"] = "role_switched"
    worker_id: str
    role: EngineRole
    previous: EngineRole
    switch_id: str = Field(max_length=64)
    drain_ms: float = Field(ge=0.0)


Message = Annotated[
    Union[Hello, Heartbeat, Stats, Output, Error, AddRequest, Abort, ReleaseKV, Shutdown, Refused, Reset, Encode,
          Encoded, SetRole, RoleSwitched],
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Message] = TypeAdapter(Message)


def encode(msg: _Msg) -> bytes:
    """Serialise a message to one msgpack frame."""
    return msgpack.packb(msg.model_dump(exclude_defaults=False), use_bin_type=True)


def decode(frame: bytes | memoryview) -> Message:
    """Parse and validate one frame (its body, once :mod:`epdserve.serving.auth` opened it).

    Raises:
        ProtocolError: the bytes are not msgpack, or not a known, well-formed message.
    """
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not msgpack ({len(frame)} bytes): {exc}") from None
    try:
        return _adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc.errors()[:3]}") from None
