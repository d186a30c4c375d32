"""Typed router↔worker messages: one msgpack map with a ``type`` per ZeroMQ frame, validated by pydantic
(unknown fields refused) so anything else raises :class:`ProtocolError` and is never deserialised into code.
Sockets, sealing, the join and each version: docs/architecture.md, "Wire rules"."""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from epdserve.engine.request import SamplingParams
from epdserve.transfer.descriptor import KVDescriptor  # noqa: F401 (re-exported: part of this wire format)
from epdserve.trace import StageTimings
from epdserve.serving.deployment import EngineRole, Role


# A router refuses a worker of another version; what each one changed: docs/architecture.md, "Handshake".
PROTOCOL_VERSION = 10


# >= 0 (Prometheus counters cannot go down), within int64
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]


class ProtocolError(ValueError):
    """A frame that is not a valid epdserve message."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ImageRef(_Msg):
    """``hash``: sha256 hex of the file bytes; ``tokens``: its ``<image>`` tokens (= embedding rows);
    ``data``: the file bytes, only to a worker that encodes it."""

    hash: str
    tokens: int = Field(ge=1)
    data: bytes | None = None


class EmbeddingRef(_Msg):
    """``images``: indices into ``AddRequest.images``, ascending; ``frame``: an encode worker's staged
    frame of their embeddings (``kind`` "shm", ``epdserve.transfer.embedding``)."""

    images: list[int]
    frame: "KVDescriptor"


class TunedChoice(_Msg):
    """Measured on the worker's machine (``model/tuning.py``); ``disturbed``: on a busy machine, not kept."""

    value: int | str
    source: Literal["cache", "measured", "disturbed"]


class Hello(_Msg):
    """A worker's first message, and its answer to :class:`Reset`. ``auth``: HMAC of ``worker_id`` under
    the token (:mod:`.handshake`); ``incarnation``: this process's random id; ``cores``: CPU cores pinned;
    ``node_id``, ``node_ip``, ``resources``: its Ray node and actor resources (local: host name, "", {});
    defaults: not given (an older worker; ``weight_format`` "": also an encode worker)."""

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
    protocol: int = 1  # absent (1) from older workers
    node_id: str = Field(default="", max_length=128)
    node_ip: str = Field(default="", max_length=64)
    resources: dict[str, float] = Field(default_factory=dict, max_length=64)
    pid: int = Field(default=0, ge=0)
    weight_format: str = Field(default="", max_length=32)
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    tuned: dict[str, TunedChoice] = Field(default_factory=dict, max_length=16)
    engine: dict[str, str | int | float | bool | None] = Field(default_factory=dict, max_length=32)


class Heartbeat(_Msg):
    """Every 0.5 s from a thread of its own, even during a long step: silence means the worker is gone.
    ``addr``: its command address, where a router that does not know it (one restarted since its
    Hello) sends ``Reset``; empty: it cannot be asked."""

    type: Literal["heartbeat"] = "heartbeat"
    worker_id: str
    incarnation: str
    addr: str = ""


class Stats(_Msg):
    """Sent after every step. Cache counters: cumulative prompt tokens (images) looked up and found
    (vLLM's meaning); ``num_steps``: forward passes since start, ``last_step_tokens`` the last one's."""

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
    num_steps: Count = 0
    last_step_tokens: Count = 0


class Output(_Msg):
    """One engine step's tokens of a request; a prefill worker sends exactly one, with ``kv`` unless finished.
    ``finish_reason``: "stop", "length" or "abort"; ``timings``: on a worker's last output. ``logprobs``: per
    token ``[logprob, [[id, logprob], ...] top]``; ``prompt_logprobs`` (first output of the prefilling worker):
    per prompt token but the first ``[logprob, rank, [[id, logprob], ...]]``, at most MAX_PROMPT_LOGPROB_ENTRIES."""

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
    """``status`` 400: the request is wrong; 500: the worker failed it. ``message``: for the client, no internals.
    ``worker_lost``: the worker is stopping (its tensor-parallel ranks failed), so the request may move to
    another worker as from a dead one (``--migration-limit``)."""

    type: Literal["error"] = "error"
    worker_id: str
    request_id: str
    message: str
    status: int = Field(400, ge=400, le=599)
    worker_lost: bool = False


class AddRequest(_Msg):
    """``kv`` and ``first_token``: to a decode worker; a prefilling worker gets the images' ``data`` or their
    ``embeddings``. ``resume_ids``: a migrated request's output so far, computed again with the prompt."""

    type: Literal["add"] = "add"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    kv: KVDescriptor | None = None
    first_token: int | None = None
    images: list[ImageRef] = []
    embeddings: list[EmbeddingRef] = []
    resume_ids: list[int] = []


class Encode(_Msg):
    """``images`` with ``data``, into one embedding frame."""

    type: Literal["encode"] = "encode"
    request_id: str
    images: list[ImageRef]


class Encoded(_Msg):
    """``frame``: held until ``ReleaseKV`` or its TTL."""

    type: Literal["encoded"] = "encoded"
    worker_id: str
    request_id: str
    frame: KVDescriptor
    timings: StageTimings = Field(default_factory=StageTimings)


class Abort(_Msg):
    type: Literal["abort"] = "abort"
    request_id: str


class ReleaseKV(_Msg):
    """The exported KV (an encode worker: the embedding frame, or the encoding) is no longer needed."""

    type: Literal["release_kv"] = "release_kv"
    request_id: str


class Shutdown(_Msg):
    type: Literal["shutdown"] = "shutdown"


class Refused(_Msg):
    """The worker exits with status 2; one of another ``incarnation`` ignores it (an address may be reused)."""

    type: Literal["refused"] = "refused"
    reason: str
    incarnation: str = ""


class Reset(_Msg):
    """To a worker taken for down and heard again (its requests already failed or moved), or heard by a
    router it never said Hello to (a restarted one): it aborts its requests, releases every export and
    says Hello again with the ``incarnation`` this names."""

    type: Literal["reset"] = "reset"
    incarnation: str


class SetRole(_Msg):
    """Take ``role``'s work at once, drain the old role's, then answer :class:`RoleSwitched` (docs/elastic.md)."""

    type: Literal["set_role"] = "set_role"
    role: EngineRole
    switch_id: str = Field(max_length=64)


class RoleSwitched(_Msg):
    """``drain_ms``: from its receipt of :class:`SetRole` ``switch_id``."""

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
    return msgpack.packb(msg.model_dump(exclude_defaults=False), use_bin_type=True)


def decode(frame: bytes | memoryview) -> Message:
    """``frame``: the body :mod:`.auth` opened. Raises ProtocolError: not msgpack, or no valid message."""
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not msgpack ({len(frame)} bytes): {exc}") from None
    try:
        return _adapter.validate_python(obj)
    except ValidationError as exc:
        raise ProtocolError(f"invalid message: {exc.errors()[:3]}") from None
