"""KV hand-off GPU to GPU on one host by CUDA IPC: :class:`DevicePool` (prefill), :class:`IpcImporter`
(decode), :func:`pinned_frame` (TCP staging). The handle's fields, why torch's ``_share_cuda_`` and
``_new_shared_cuda``, why tags in host memory, and the release rules: docs/gpu-handoff.md."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import weakref
from typing import Literal, Protocol

import msgpack
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from epdserve.transfer import shm, wire
from epdserve.transfer.wire import TensorHeader, WireError

HANDLE_BYTES = 66  # torch's handle of a cudaMalloc block: version byte, b"c", cudaIpcMemHandle_t (64 bytes)
EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
MAX_PACKED_BYTES = 4096
# torch's ref-counter file (at::NewProcessWideShmHandle) and its slots; the importer decrements one at close.
_REF_COUNTER = re.compile(rb"/torch_([0-9]{1,10})_[0-9]{1,20}_[0-9]{1,20}")
REF_COUNTER_SLOTS = 10000
KV_DTYPES = {name: dtype for name, dtype in wire.DTYPES.items() if name != "int8"}
_DTYPE_NAMES = {dtype: name for name, dtype in KV_DTYPES.items()}
_LAYOUT_AXES = {"num_layers": 0, "block_size": 3, "num_kv_heads": 4, "head_dim": 5}


class IpcError(WireError):
    """A CUDA IPC handle that is malformed, or that this process cannot open or use."""


class IpcHandle(BaseModel):
    """What a descriptor's ``ipc`` carries (fields: docs/gpu-handoff.md); strict, never unpickled. Raises
    ValueError naming every bad field (:class:`IpcError` from :func:`make_handle` and :func:`unpack_handle`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    backend: Literal["cuda", "fake"]
    pool_id: str
    owner_pid: int
    device_index: int
    device_uuid: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync: bool
    dtype: str
    shape: list[int]

    @model_validator(mode="after")
    def _consistent(self) -> IpcHandle:
        problems = _problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def num_blocks(self) -> int:
        return self.shape[2]

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.dtype]


def _problems(h: IpcHandle) -> list[str]:
    out = []
    if not shm.TAGS.fullmatch(h.pool_id):
        out.append(f"pool_id {h.pool_id!r} is not a KV tag file's name")
    if h.owner_pid < 1 or h.device_index < 0 or not 0 < len(h.device_uuid) <= 64:
        out.append(f"owner pid {h.owner_pid}, device {h.device_index} {h.device_uuid!r}: not a process and a GPU")
    if len(h.handle) != HANDLE_BYTES:
        out.append(f"handle is {len(h.handle)} bytes, a CUDA IPC handle is {HANDLE_BYTES}")
    elif h.handle[1:2] != b"c":
        out.append(f"handle type {h.handle[1:2]!r} is not a cudaMalloc block's (b'c'): the KV cache lies in "
                   "an expandable segment; start the prefill worker without expandable_segments in "
                   "PYTORCH_CUDA_ALLOC_CONF")
    if len(h.event_handle) != EVENT_HANDLE_BYTES:
        out.append(f"event_handle is {len(h.event_handle)} bytes, a CUDA IPC event handle is {EVENT_HANDLE_BYTES}")
    counter = _REF_COUNTER.fullmatch(h.ref_counter)
    # The importer writes into this file when it closes the handle: only ever the owner's.
    if not counter or int(counter.group(1)) != h.owner_pid or not 0 <= h.ref_counter_offset < REF_COUNTER_SLOTS:
        out.append(f"ref counter {h.ref_counter[:64]!r} slot {h.ref_counter_offset} is not torch's of "
                   f"process {h.owner_pid}")
    if h.dtype not in KV_DTYPES:
        return out + [f"dtype {h.dtype!r} is not a KV cache dtype ({', '.join(KV_DTYPES)})"]
    if len(h.shape) != 6 or h.shape[1] != 2 or min(h.shape) < 1:
        return out + [f"shape {h.shape} is not [layers, 2, num_blocks, block_size, kv_heads, head_dim]"]
    need = KV_DTYPES[h.dtype].itemsize
    for d in h.shape:
        need *= d
    if h.size_bytes != need:
        out.append(f"size_bytes {h.size_bytes} does not fit shape {h.shape} {h.dtype} ({need} bytes)")
    if h.offset_bytes < 0 or h.offset_bytes % KV_DTYPES[h.dtype].itemsize:
        out.append(f"offset_bytes {h.offset_bytes} is not a {h.dtype} element's offset")
    return out


def _explain(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors(include_url=False):
        where = ".".join(map(str, e["loc"]))
        parts.append(f"{where + ': ' if where else ''}{e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def make_handle(**fields) -> IpcHandle:
    """Raises IpcError naming every problem."""
    try:
        return IpcHandle.model_validate(fields)
    except ValidationError as exc:
        raise IpcError(f"invalid CUDA IPC handle: {_explain(exc)}") from None


def pack_handle(handle: IpcHandle) -> bytes:
    """``handle`` as msgpack bytes (what a descriptor's ``ipc`` carries)."""
    return msgpack.packb(handle.model_dump(), use_bin_type=True)


def unpack_handle(data: bytes) -> IpcHandle:
    """From the network: msgpack, never unpickled. Raises IpcError: not 1..:data:`MAX_PACKED_BYTES` bytes, not a
    msgpack map, or invalid."""
    if not isinstance(data, bytes) or not 0 < len(data) <= MAX_PACKED_BYTES:
        raise IpcError(f"a CUDA IPC handle is 1 to {MAX_PACKED_BYTES} bytes, not {type(data).__name__} "
                       f"of {len(data) if isinstance(data, bytes) else '?'}")
    try:
        fields = msgpack.unpackb(data, raw=False)
    except Exception:  # msgpack raises several unrelated types
        raise IpcError("CUDA IPC handle is not msgpack") from None
    if not isinstance(fields, dict):
        raise IpcError(f"CUDA IPC handle is a msgpack {type(fields).__name__}, not a map")
    return make_handle(**{str(k): v for k, v in fields.items()})


def check_layout(handle: IpcHandle, layout: dict) -> None:
    """Raises :class:`IpcError` naming each difference from ``layout`` (``LLMEngine.kv_layout()``; dtype aside)."""
    diff = [f"{key} {handle.shape[axis]} (theirs) vs {layout.get(key)!r} (ours)"
            for key, axis in _LAYOUT_AXES.items() if handle.shape[axis] != layout.get(key)]
    if diff:
        raise IpcError(f"KV layout of pool {handle.pool_id} differs from this worker's: {', '.join(diff)}")


def exporter_alive(handle: IpcHandle) -> bool:
    """And its tag file is still there (a reused pid reads as alive; the tag file still tells)."""
    return shm.pid_alive(handle.owner_pid) and shm.pool_exists(handle.pool_id)


class IpcBackend(Protocol):
    """How a GPU allocation is shared and opened. ``name``: :attr:`IpcHandle.backend`."""

    name: str

    def device_uuids(self) -> list[str]:
        """The UUIDs of the GPUs this process sees, by its device index."""

    def share(self, kv: torch.Tensor, pool_id: str) -> dict:
        """The :class:`IpcHandle` fields ``owner_pid`` .. ``event_sync`` of the whole contiguous ``kv``; ValueError."""

    def open(self, handle: IpcHandle, index: int) -> torch.Tensor:
        """The exporter's cache on this process's GPU ``index``. Raises IpcError (or torch's error)."""

    def close(self, kv: torch.Tensor) -> None:
        """This process no longer uses ``kv`` (a tensor :meth:`open` returned)."""


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.insert(0, step)
        step *= d
    return strides


class CudaBackend:
    """CUDA IPC through torch's caching allocator (see the module doc for why these calls)."""

    name = "cuda"

    def __init__(self):
        self._uuids: list[str] | None = None

    def device_uuids(self) -> list[str]:
        if self._uuids is None:  # a process's GPUs do not change: asked once (every import asks)
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self._uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
        return self._uuids

    def share(self, kv: torch.Tensor, pool_id: str) -> dict:
        whole = kv.is_contiguous() and not kv.storage_offset() and kv.untyped_storage().nbytes() == kv.nbytes
        if not kv.is_cuda or not whole:
            raise ValueError(f"only a whole contiguous CUDA tensor is shared by CUDA IPC, not a {kv.device} one")
        # The exporter's storage lives as long as the pool, so torch's ref counter never reaches zero.
        device, handle, size, offset, ref_counter, ref_slot, event, sync = kv.untyped_storage()._share_cuda_()
        return {"owner_pid": os.getpid(), "device_index": int(device), "device_uuid": self.device_uuids()[device],
                "handle": bytes(handle), "size_bytes": int(size), "offset_bytes": int(offset),
                "ref_counter": bytes(ref_counter), "ref_counter_offset": int(ref_slot),
                "event_handle": bytes(event), "event_sync": bool(sync)}

    def open(self, handle: IpcHandle, index: int) -> torch.Tensor:
        torch.cuda.init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, handle.handle, handle.size_bytes, handle.offset_bytes, handle.ref_counter,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync)
        view = torch.empty(0, dtype=handle.torch_dtype, device=storage.device)
        return view.set_(storage, 0, handle.shape, _contiguous_strides(handle.shape))

    def close(self, kv: torch.Tensor) -> None:
        # Freeing the last view runs _new_shared_cuda's deleter: stream wait, ref counter, cudaIpcCloseMemHandle.
        del kv


# The fake's "GPU memory": tensors by pool id, dropped with their pools.
_FAKE_POOLS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def _fake_handle(pool_id: str) -> bytes:
    """The fake's handle of pool ``pool_id``: shaped as torch's (version, b"c", 64 bytes)."""
    return b"\x03c" + hashlib.sha256(pool_id.encode()).digest() * 2


class FakeBackend:
    """A CPU stand-in for tests: :meth:`share` registers the tensor by pool id, :meth:`open` looks it up (same
    process). ``owner_pid``: a dead pid plays a dead exporter; ``open_count``: opens not closed."""

    name = "fake"

    def __init__(self, uuids: tuple[str, ...] = ("fake-gpu-0",), owner_pid: int | None = None):
        self.uuids = list(uuids)
        self.owner_pid = owner_pid
        self.open_count = 0

    def device_uuids(self) -> list[str]:
        return self.uuids

    def share(self, kv: torch.Tensor, pool_id: str) -> dict:
        if not kv.is_contiguous() or kv.storage_offset():
            raise ValueError("only a whole contiguous tensor is shared")
        _FAKE_POOLS[pool_id] = kv
        pid = self.owner_pid or os.getpid()
        return {"owner_pid": pid, "device_index": 0, "device_uuid": self.uuids[0],
                "handle": _fake_handle(pool_id), "size_bytes": kv.nbytes,
                "offset_bytes": 0, "ref_counter": f"/torch_{pid}_0_0".encode(), "ref_counter_offset": 0,
                "event_handle": bytes(EVENT_HANDLE_BYTES), "event_sync": False}

    def open(self, handle: IpcHandle, index: int) -> torch.Tensor:
        kv = _FAKE_POOLS.get(handle.pool_id)
        if kv is None or handle.handle != _fake_handle(handle.pool_id):
            raise IpcError(f"cudaIpcOpenMemHandle failed (fake): no allocation for pool {handle.pool_id}")
        self.open_count += 1
        return kv.view(handle.torch_dtype).view(handle.shape)

    def close(self, kv: torch.Tensor) -> None:
        self.open_count -= 1


class DevicePool:
    """``kv`` (zeros) on ``device``, its tags in a /dev/shm ``TagFile`` named ``name`` (the pool id), :attr:`handle`
    made once. Raises IpcError (not shareable, e.g. expandable segments), ValueError (device), OSError (/dev/shm)."""

    kind = "cuda_ipc"

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 backend: IpcBackend | None = None):
        self.backend = backend or CudaBackend()
        self.shape = tuple(shape)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"a KV cache of {dtype} cannot be shared (one of {', '.join(KV_DTYPES)})")
        self.kv = torch.zeros(self.shape, dtype=dtype, device=device)
        self._tag_file = shm.TagFile(self.shape[2])
        self.name, self.tags = self._tag_file.name, self._tag_file.tags
        try:
            self.handle = make_handle(backend=self.backend.name, pool_id=self.name, dtype=_DTYPE_NAMES[dtype],
                                      shape=list(self.shape), **self.backend.share(self.kv, self.name))
        except BaseException:
            self.close()
            raise
        self.handle_bytes = pack_handle(self.handle)

    @property
    def parts(self) -> list[torch.Tensor]:
        """The cache as a :class:`KVPool`'s parts: one part of every KV head."""
        return [self.kv]

    @property
    def head_split(self) -> list[int]:
        return [self.shape[4]]

    def close(self) -> None:
        """Idempotent; importers then drop the pool and refuse its descriptors."""
        self._tag_file.close()


class IpcImporter:
    """Decode side: each pool opened once (CUDA allows one open per process), kept until its exporter is gone
    or :meth:`close`. Thread-safe (fetch threads import concurrently)."""

    def __init__(self, backend: IpcBackend | None = None):
        self._backend = backend
        self._opened: dict[str, tuple[IpcHandle, torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def backend(self) -> IpcBackend:
        if self._backend is None:
            self._backend = CudaBackend()
        return self._backend

    def can_open(self, handle: IpcHandle) -> bool:
        """Whether this process can open ``handle`` (same backend, and it sees that GPU)."""
        return handle.backend == self.backend.name and handle.device_uuid in self.backend.device_uuids()

    def open(self, handle: IpcHandle, layout: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The exporter's cache and its host tags, opened once. Raises IpcError (layout, backend, an unseen GPU, a
        pool id reused with another handle, a failed open) and WireError (tag file gone or not the handle's)."""
        check_layout(handle, layout)
        with self._lock:
            self._drop_dead()
            known = self._opened.get(handle.pool_id)
            if known is not None:
                if known[0] != handle:
                    raise IpcError(f"pool {handle.pool_id} is open with another handle: refusing this one")
                return known[1], known[2]
            uuids = self.backend.device_uuids()
            if handle.backend != self.backend.name or handle.device_uuid not in uuids:
                raise IpcError(f"cannot open {handle.backend} pool {handle.pool_id}: its GPU {handle.device_uuid} "
                               f"(the exporter's device {handle.device_index}) is not one this process sees "
                               f"({self.backend.name}, {len(uuids)} GPUs: check CUDA_VISIBLE_DEVICES)")
            tags = shm.map_tags(handle.pool_id, handle.num_blocks)
            try:
                kv = self.backend.open(handle, uuids.index(handle.device_uuid))
            except RuntimeError as exc:  # torch's own errors from cudaIpcOpenMemHandle
                raise IpcError(f"cannot open pool {handle.pool_id}: {exc}") from None
            self._opened[handle.pool_id] = (handle, kv, tags)
            return kv, tags

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._opened)

    def close(self, pool_id: str | None = None) -> None:
        """None: every pool. A handle is released once no tensor views it (an engine's import keeps it)."""
        with self._lock:
            for key in [pool_id] if pool_id is not None else list(self._opened):
                self._close_locked(key)

    def _drop_dead(self) -> None:
        for key in [k for k, (handle, _, _) in self._opened.items() if not exporter_alive(handle)]:
            self._close_locked(key)

    def _close_locked(self, pool_id: str) -> None:
        entry = self._opened.pop(pool_id, None)
        if entry is not None:
            self.backend.close(entry[1])


def pinned_frame(header: TensorHeader, fill, pin: bool = True):
    """A wire frame for ``header`` in a new host buffer, page-locked with ``pin`` (needs CUDA) so that ``fill``
    copies GPU blocks by DMA at full speed; a numpy array ZeroMQ sends without a copy."""
    buffer = torch.empty(wire.frame_size(header), dtype=torch.uint8, pin_memory=pin).numpy()
    return wire.pack(header, fill, buffer)
