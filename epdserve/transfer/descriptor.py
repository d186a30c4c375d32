"""Where a request's exported KV cache (or an encode worker's embedding frame) lies: the
descriptor a prefill worker's :class:`~epdserve.transfer.handoff.Exporter` makes and an
:class:`~epdserve.transfer.handoff.Importer` follows. It rides inside the router's
messages (:mod:`epdserve.serving.protocol`: ``Output.kv``, ``AddRequest.kv``,
``Encoded.frame``), encoded as they are."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class KVDescriptor(BaseModel):
    """Where a request's exported KV cache lies (see ``epdserve.transfer.handoff``).

    ``kind`` "shm": ``name`` is a file in the /dev/shm of host ``host_id`` holding one wire
    frame (see ``epdserve.transfer.wire``) of ``nbytes`` bytes. ``kind`` "pool": ``name``
    is the prefill worker's whole KV cache in the /dev/shm of host ``host_id``
    (``epdserve.transfer.shm.KVPool``), of ``pool_blocks`` blocks laid out as ``layout``
    (``LLMEngine.kv_layout()``); the request's KV is the blocks ``block_runs`` (``[first
    block, count]`` runs, in order), each tagged ``tag`` while it is held; the pool holds
    one part per rank of the prefill worker, ``head_split`` their KV heads in order (empty:
    one part of every head; see ``epdserve.engine.kv_parts``). Both:
    ``num_tokens`` is how many prompt positions it covers; ``addr`` (``tcp://HOST:PORT``,
    or None) is the prefill worker's KV socket that serves the same KV as one frame of
    ``nbytes`` bytes to a decode worker on another host. The receiver validates every
    field against what it maps or fetches.

    ``kind`` "cuda_ipc": as "pool", but the cache lies on a GPU of host ``host_id``: ``ipc``
    is its CUDA IPC handle (``epdserve.transfer.cuda_ipc.pack_handle``: msgpack bytes, the
    same in every descriptor of the pool) and ``name`` the pool's id, its tag file in
    /dev/shm; a decode worker opens the handle once and copies the blocks GPU to GPU.
    """

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
