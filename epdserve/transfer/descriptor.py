"""Where a request's exported KV (or an encode worker's embedding frame) lies; it rides inside the router's
msgpack messages (``Output.kv``, ``AddRequest.kv``, ``Encoded.frame``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KVDescriptor(BaseModel):
    """``kind`` "shm": ``name`` is a /dev/shm file on host ``host_id`` holding one wire frame of ``nbytes``.
    "pool": ``name`` is the prefill worker's whole KV cache there (``shm.KVPool``, ``pool_blocks`` blocks,
    ``layout`` as ``LLMEngine.kv_layout()``); the KV is ``block_runs`` (``[first, count]``, in order), each
    block tagged ``tag`` while held; ``head_split``: the KV heads of each rank's part (empty: one part).
    "cuda_ipc": as "pool" on a GPU; ``ipc``: the packed handle, ``name``: the pool id. ``num_tokens``: prompt
    positions; ``addr``: the prefill worker's KV socket, serving the same KV as one ``nbytes`` frame across
    hosts. The receiver validates every field."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["shm", "pool", "cuda_ipc"] = "shm"
    name: str
    num_tokens: int
    nbytes: int
    host_id: str
    addr: str | None = None
    block_runs: list[tuple[int, int]] = []
    pool_blocks: int = 0
    layout: dict = {}
    tag: int = 0
    ipc: bytes = Field(b"", max_length=4096)
    head_split: list[int] = Field([], max_length=1024)
