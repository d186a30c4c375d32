"""One request's KV blocks from a prefill worker to a decode worker, end to end.

The prefill side (:class:`Exporter`) hands KV over in one of these ways:

* **held pool blocks** (``--kv-transfer-dtype none`` with the engine's cache in a shared
  :class:`~epdserve.transfer.shm.KVPool`, the prefill worker's default): it copies
  nothing; it keeps the prompt's blocks allocated and tagged, and its descriptor names the
  pool, the blocks and the layout. A decode worker on the same host maps the pool once,
  and its engine copies the blocks straight into its own cache when it imports them
  (:class:`PooledKV`: one copy in all); one on another host fetches them over TCP as one
  frame, built from the held blocks when asked. Should ``--kv-ttl`` pass before the decode
  engine imports them (a decode worker queueing the request that long), the import finds
  the tags gone and raises rather than use reused blocks.
* **held GPU blocks** (the same, with the engine's cache on a GPU in a
  :class:`~epdserve.transfer.cuda_ipc.DevicePool`): the descriptor carries the pool's CUDA
  IPC handle; a decode worker on the same host that sees that GPU opens it once and its
  engine copies the blocks GPU to GPU (same or another GPU); any other decode worker
  fetches them over TCP, staged through page-locked host memory.
* a **staged frame** (bf16/int8, ``--kv-layer-pipeline``, or no pool): it writes the
  blocks, converted as ``--kv-transfer-dtype`` says (:mod:`epdserve.transfer.kv_codec`),
  as one wire frame to a /dev/shm segment and frees them; with ``--kv-layer-pipeline``
  each layer's blocks are written as soon as the forward pass has computed that layer
  (the copy moves into the prefill step, the hand-off after it shrinks to closing the
  frame). The decode side maps the segment (same host) or fetches it over TCP. From a
  GPU cache the frame is written device → host, converted first on the GPU (int8:
  :func:`~epdserve.transfer.pipeline.read_where_cached`; bf16: the casting copy).

:class:`Importer` picks shared memory (or CUDA IPC, for a GPU pool it can open) when the
KV lies on its own host and the transport allows it (transport ``auto``, the default), TCP
otherwise (docs/gpu-handoff.md has the table), and converts the blocks to its
own cache dtype, which may differ from the prefill side's.

The prefill side holds a request's KV (blocks or segment) in its one table of live
exports (:mod:`epdserve.transfer.exports`) until the router releases it (``ReleaseKV``,
sent once the decode worker has imported it, and on every failure or abort), or its TTL
passes; a mapped or served segment is unlinked at once.

A request's KV, in order. Prefill side: ``LLMEngine.add_request(hold_kv=True[,
layer_sink])`` → ``LLMEngine.step`` (``LayerPipeline.write_layer`` per layer, pipelined) →
the first token's ``StepOutput.kv_block_ids`` (the engine's hold) → :meth:`Exporter.export`
(``ExportTable.hold``, or a segment and ``LLMEngine.release_kv``) → ``ReleaseKV`` /
TTL → ``ExportTable.release``. Decode side: :meth:`Importer.take` (a ``KVSource``) →
``LLMEngine.add_request(kv=...)`` (``KVSource.validate``) → ``LLMEngine.step``
(``KVSource.copy_into``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import torch
import zmq

from epdserve.engine.engine import LLMEngine
from epdserve.engine.outputs import StepOutput
from epdserve.engine.kv_parts import KVParts
from epdserve.engine.kv_source import KVSource, TensorKV, block_runs
from epdserve.transfer import cuda_ipc, kv_codec, shm, tcp, wire
from epdserve.transfer.descriptor import KVDescriptor
from epdserve.transfer.exports import ExportTable
from epdserve.transfer.pipeline import LayerPipeline, read_where_cached
from epdserve.transfer.pooled import PooledKV, wait_for_copies
from epdserve.transfer.wire import TensorHeader, WireError
from epdserve.trace import StageTimings

TRANSPORTS = ("auto", "shm", "tcp")


def host_id() -> str:
    """An id shared by exactly the processes that can map each other's /dev/shm files and
    reach each other's 127.0.0.1: a hash of the machine id (or host name), the device and
    inode of /dev/shm, and the network namespace's inode (separate namespaces on one
    machine, as in containers, count as separate hosts)."""
    try:
        machine = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine = socket.gethostname()
    st = os.stat(shm.SHM_DIR)
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return hashlib.sha256(f"{machine}|{st.st_dev}|{st.st_ino}|{netns}".encode()).hexdigest()[:16]


class Exporter:
    """Prefill side. ``bind``: the TCP address to serve KV on (``tcp://HOST:PORT``, port 0
    = any free one), or None for shared memory only. ``ttl_s``: seconds KV nobody took is
    kept. ``transfer_dtype``: one of ``kv_codec.TRANSFER_DTYPES``. ``pool``: the shared
    pool holding ``engine.kv_cache`` (host or GPU, see :func:`new_engine`), or None.
    ``layer_pipeline``: write staged frames layer by layer during the prefill step:
    ``layer_sink`` (None without) is then the :class:`~epdserve.transfer.pipeline.LayerPipeline`
    that requests to export pass to :meth:`LLMEngine.add_request` with ``hold_kv``.

    The exporter's live exports are :attr:`table` (:class:`~epdserve.transfer.exports.ExportTable`):
    :meth:`export` adds to it, :meth:`release` and :meth:`expire` go through it.

    Raises (constructor): ``zmq.ZMQError`` if ``bind`` cannot be bound; ``ValueError``
    for an unknown ``transfer_dtype`` or a ``pool`` that does not hold the engine's cache.
    """

    def __init__(self, engine: LLMEngine, ttl_s: float, ctx: zmq.Context, bind: str | None,
                 transfer_dtype: str = "none", pool: shm.KVPool | cuda_ipc.DevicePool | None = None,
                 layer_pipeline: bool = False):
        if transfer_dtype not in kv_codec.TRANSFER_DTYPES:
            raise ValueError(f"unknown KV transfer dtype {transfer_dtype!r}")
        if pool is not None and pool.parts[0].data_ptr() != engine.kv_cache.data_ptr():
            raise ValueError("the shared KV pool must hold the engine's KV cache (see LLMEngine's kv_allocator)")
        self.engine = engine
        self.transfer_dtype = transfer_dtype
        self.pool = pool
        self.hold = pool is not None and transfer_dtype == "none" and not layer_pipeline
        self.host = host_id()
        self.table = ExportTable(ttl_s, pool if self.hold else None, engine.release_kv)
        self.layer_sink = LayerPipeline(engine, self._header) if layer_pipeline else None
        self.server = tcp.KVServer(ctx, bind, self._frame) if bind else None

    @property
    def ttl_s(self) -> float:
        return self.table.ttl_s

    def _header(self, num_blocks: int) -> TensorHeader:
        layout = self.engine.kv_layout()
        shape = list(self.engine.kv_block_shape(num_blocks))  # every KV head, whatever the ranks
        return TensorHeader(tensors=kv_codec.specs(shape, self.engine.kv_cache.dtype,
                                                   "none" if self.hold else self.transfer_dtype),
                            layout=layout, num_tokens=num_blocks * layout["block_size"])

    def export(self, out: StepOutput) -> KVDescriptor:
        """Hand over the held blocks ``out.kv_block_ids`` (the engine's hold of a ``hold_kv``
        request): keep them held and tagged in the pool, or write them to a segment (or
        close the segment the layers were written to) and end the engine's hold. Adds
        ``kv_export_ms`` and ``kv_bytes`` (bytes a TCP fetch moves) to ``out.timings``, and
        for a layer-pipelined frame ``kv_layer_copy_ms`` (the copies made during the
        prefill step, part of its ``prefill_ms``).

        Raises:
            OSError: /dev/shm is full or not writable.
        """
        start = time.perf_counter()
        ids, request_id = out.kv_block_ids, out.request_id
        header = self._header(len(ids))
        addr = self.server.addr if self.server else None
        nbytes = wire.frame_size(header)
        # A block already held for another hand-off cannot be held twice: such an export is staged (copied).
        if self.hold and self.table.can_hold(ids):
            entry = self.table.hold(request_id, ids, header)
            wait_for_copies(self.engine.kv_cache)  # a GPU's writes of the prompt's KV end before a peer reads it
            desc = KVDescriptor(kind=self.pool.kind, name=self.pool.name, num_tokens=header.num_tokens, nbytes=nbytes,
                                host_id=self.host, addr=addr, block_runs=[(b, n) for _, b, n in block_runs(ids)],
                                pool_blocks=self.pool.shape[2], layout=header.layout, tag=entry.tag,
                                head_split=self.pool.head_split,
                                ipc=self.pool.handle_bytes if isinstance(self.pool, cuda_ipc.DevicePool) else b"")
        else:
            name = self._stage(request_id, ids, header, out.timings)
            self.engine.release_kv(request_id)
            self.table.add_segment(request_id, name)
            desc = KVDescriptor(name=name, num_tokens=header.num_tokens, nbytes=nbytes, host_id=self.host, addr=addr)
        out.timings.kv_export_ms = (time.perf_counter() - start) * 1e3
        out.timings.kv_bytes = float(nbytes)
        return desc

    def _stage(self, request_id: str, ids: list[int], header: TensorHeader, timings: StageTimings) -> str:
        """The segment holding the blocks: the layer-pipelined one, closed, or a new one."""
        finished = self.layer_sink.finish(request_id) if self.layer_sink is not None else None
        if finished is not None:
            name, timings.kv_layer_copy_ms = finished
            return name

        def fill(views: dict[str, torch.Tensor]) -> None:
            if "scales" in views:
                kv_codec.encode(read_where_cached(self.engine, ids, views["kv"].shape), views)
            else:  # none, bf16: straight from the cache into the frame, one (casting) copy
                self.engine.read_kv(ids, out=views["kv"])

        name = shm.new_name()
        shm.write(name, header, fill)
        return name

    def _frame(self, request_id: str, name: str):
        """KV server source (runs on its thread): the frame of a held request, built now,
        or its segment's mapping (unlinking it)."""
        entry = self.table.get(request_id)
        if entry is None or entry.name != name:
            raise WireError(f"no KV {name} for request {request_id}")
        if entry.blocks is None:
            return shm.open_segment(name)

        def fill(views: dict[str, torch.Tensor]) -> None:
            self.engine.read_kv(entry.blocks, out=views["kv"])

        # From a GPU: device → page-locked buffer → socket (an RDMA/NIXL transport would read the blocks instead).
        if self.engine.kv_cache.is_cuda:
            frame = cuda_ipc.pinned_frame(entry.header, fill)
        else:
            frame = wire.pack(entry.header, fill)
        if self.table.get(request_id) is not entry:  # released, so maybe reused, during the copy
            raise WireError(f"KV of request {request_id} was released while it was being sent")
        return frame

    def release(self, request_id: str) -> None:
        """Give up the request's KV if it is still held (imported, abort, TTL): see
        :meth:`ExportTable.release`."""
        self.table.release(request_id)

    def expire(self) -> list[str]:
        """Release every export older than the TTL; returns their request ids. Also deletes
        layer-pipelined frames of requests the engine no longer runs."""
        if self.layer_sink is not None:
            self.layer_sink.drop_finished()
        return self.table.expire()

    def close(self) -> None:
        """Stop serving, release every export still held, delete pending frames and the pool file."""
        if self.server is not None:
            self.server.close()
        self.table.close()
        if self.layer_sink is not None:
            self.layer_sink.close()
        if self.pool is not None:
            self.pool.close()


class Importer:
    """Decode side. ``transport``: "auto" (the same host's shared memory or CUDA IPC, else
    TCP), "shm" (same host only) or "tcp". ``timeout_s``: the longest a TCP fetch may take.
    Keeps each prefill pool it maps mapped (one mapping per pool, dropped once the pool's
    file is gone) and each GPU pool it opens open (:attr:`ipc`, an
    :class:`~epdserve.transfer.cuda_ipc.IpcImporter` of ``ipc_backend``, default CUDA).
    :meth:`take` and :meth:`fetch_frame` may run on several threads at once (a worker
    fetches off its step loop); they never touch an engine."""

    def __init__(self, ctx: zmq.Context, transport: str, timeout_s: float,
                 ipc_backend: cuda_ipc.IpcBackend | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown KV transport {transport!r} (choose from {', '.join(TRANSPORTS)})")
        self.ctx = ctx
        self.transport = transport
        self.timeout_s = timeout_s
        self.host = host_id()
        self.pools: dict[tuple, tuple[list[torch.Tensor], torch.Tensor]] = {}
        self._pools_lock = threading.Lock()  # fetch threads map pools concurrently
        self.ipc = cuda_ipc.IpcImporter(ipc_backend)

    def take(self, request_id: str, desc: KVDescriptor, layout: dict, dtype: torch.dtype,
             cancel: threading.Event | None = None,
             device: torch.device | str | None = None) -> tuple[KVSource, StageTimings]:
        """Get the KV blocks ``desc`` describes as a :class:`~epdserve.engine.kv_source.KVSource`
        of blocks ``[layers, 2, n_blocks, block_size, kv_heads, head_dim]`` in ``dtype``: a
        :class:`~epdserve.engine.kv_source.TensorKV` of the frame's tensor (moved to
        ``device`` first when given, so that int8 is dequantized there), or for blocks of a
        same-host pool a :class:`~epdserve.transfer.pooled.PooledKV` (the engine copies
        them straight into its cache on import; from a GPU pool by CUDA IPC when this
        process sees that GPU, else, with "auto", over TCP); and timings ``kv_fetch_ms``
        (ms: fetch, map or open, validation and conversion) and ``kv_tcp`` (1.0 if it came
        over TCP, else 0.0). Blocks up to ``timeout_s`` on TCP, or until ``cancel`` is set.

        Raises:
            WireError: the KV is gone (expired, released), unreachable, malformed, on another
                host while the transport is "shm", or without a TCP address while TCP is
                needed; a pool descriptor whose name, blocks, tag or sizes do not check out;
                a TCP fetch cancelled; (``IpcError``) a CUDA IPC handle that is malformed,
                of another layout or a GPU this process does not see, or whose exporter is
                gone.
            ValueError: its KV layout differs from ``layout`` (in anything but the dtype).
        """
        start = time.perf_counter()
        handle = cuda_ipc.unpack_handle(desc.ipc) if desc.kind == "cuda_ipc" else None
        if self._from_same_host_pool(desc, handle):
            kv = self._from_pool(request_id, desc, layout, dtype, handle)
            return kv, StageTimings(kv_fetch_ms=(time.perf_counter() - start) * 1e3, kv_tcp=0.0)
        header, tensors = self.fetch_frame(request_id, desc, cancel)
        _check_layout(header.layout, layout)
        if device is not None:
            tensors = {name: t.to(device) for name, t in tensors.items()}
        kv = TensorKV(kv_codec.decode(tensors, dtype))
        return kv, StageTimings(kv_fetch_ms=(time.perf_counter() - start) * 1e3, kv_tcp=float(self._over_tcp(desc)))

    def _from_same_host_pool(self, desc: KVDescriptor, handle: cuda_ipc.IpcHandle | None) -> bool:
        """Whether to copy ``desc``'s blocks straight out of its pool: it is one on this host
        and the transport allows it; for a GPU pool this process cannot open, "auto" falls
        back to TCP (staged by the prefill worker) when the worker serves it."""
        if desc.kind == "shm" or self.uses_tcp(desc) or desc.host_id != self.host:
            return False
        return handle is None or self.transport != "auto" or desc.addr is None or self.ipc.can_open(handle)

    def uses_tcp(self, desc: KVDescriptor) -> bool:
        """Whether what ``desc`` describes comes over TCP (else from this host's /dev/shm)."""
        return self.transport == "tcp" or (self.transport == "auto" and desc.host_id != self.host)

    def _over_tcp(self, desc: KVDescriptor) -> bool:
        """Whether a frame of ``desc`` is fetched over TCP: :meth:`uses_tcp`, or the blocks
        of a GPU pool (a frame of them exists only as the prefill worker's TCP reply)."""
        return self.uses_tcp(desc) or desc.kind == "cuda_ipc"

    def fetch_frame(self, request_id: str, desc: KVDescriptor,
                    cancel: threading.Event | None = None) -> tuple[TensorHeader, dict[str, torch.Tensor]]:
        """The frame ``desc`` describes (a staged KV frame, or an encode worker's
        embeddings; or a pool's blocks served as one frame over TCP): mapped and unlinked
        from /dev/shm on this host, else fetched over TCP (up to ``timeout_s``, or until
        ``cancel`` is set).

        Raises:
            WireError: as :meth:`take`.
        """
        if self._over_tcp(desc):
            if desc.addr is None:
                raise WireError(f"{desc.name} lies on another host and its sender serves no TCP address")
            return tcp.fetch(self.ctx, desc.addr, request_id, desc.name, desc.nbytes, self.timeout_s, cancel)
        if desc.host_id != self.host:
            raise WireError(f"{desc.name} lies on another host and --kv-transport is shm")
        return shm.read(desc.name)

    def _from_pool(self, request_id: str, desc: KVDescriptor, layout: dict, dtype: torch.dtype,
                   handle: cuda_ipc.IpcHandle | None) -> PooledKV:
        block_size = layout["block_size"]
        _check_runs(request_id, desc, block_size, handle.num_blocks if handle is not None else desc.pool_blocks)
        runs = [tuple(run) for run in desc.block_runs]
        if handle is not None:
            if desc.name != handle.pool_id:
                raise cuda_ipc.IpcError(f"KV descriptor for {request_id} names pool {desc.name}, "
                                        f"its handle {handle.pool_id}")
            pool, tags = self.ipc.open(handle, layout)
            alive = functools.partial(cuda_ipc.exporter_alive, handle)
            kv = PooledKV(request_id, KVParts([pool]), tags, runs, desc.tag, dtype, alive)
        else:
            _check_layout(desc.layout, layout)
            name = desc.layout.get("dtype")
            pool_dtype = wire.DTYPES.get(name) if isinstance(name, str) else None
            if pool_dtype is None or pool_dtype == torch.int8:
                raise WireError(f"unsupported KV pool dtype {name!r}")
            shape = (layout["num_layers"], 2, desc.pool_blocks, block_size, layout["num_kv_heads"], layout["head_dim"])
            parts, tags = self._map(desc.name, shape, pool_dtype, _head_split(request_id, desc, layout))
            kv = PooledKV(request_id, KVParts(parts), tags, runs, desc.tag, dtype)
        kv.check()
        return kv

    def _map(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             head_split: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
        key = (name, shape, dtype, tuple(head_split))
        with self._pools_lock:
            if key not in self.pools:
                # Pools of prefill workers that have stopped: unmap them (they hold memory).
                for old in [k for k in self.pools if not shm.pool_exists(k[0])]:
                    del self.pools[old]
                self.pools[key] = shm.map_pool(name, shape, dtype, head_split)
            return self.pools[key]

    def close(self) -> None:
        """Drop every mapped pool and close every GPU pool opened (a stopping worker)."""
        with self._pools_lock:
            self.pools.clear()
        self.ipc.close()


def _check_runs(request_id: str, desc: KVDescriptor, block_size: int, pool_blocks: int) -> None:
    """Raises :class:`WireError` unless ``desc``'s block runs cover its tokens inside a pool
    of ``pool_blocks`` blocks and it names a tag."""
    num_blocks = -(-desc.num_tokens // block_size)
    runs = desc.block_runs
    if (desc.num_tokens < 1 or desc.tag < 1 or sum(n for _, n in runs) != num_blocks
            or any(first < 0 or n < 1 or first + n > pool_blocks for first, n in runs)):
        shown = f"{runs[:4]}{'...' if len(runs) > 4 else ''}"
        raise WireError(f"KV descriptor for {request_id} is invalid: blocks {shown} for {desc.num_tokens} "
                        f"tokens in a pool of {pool_blocks} blocks, tag {desc.tag}")


def _head_split(request_id: str, desc: KVDescriptor, layout: dict) -> list[int]:
    """The KV heads of each part of ``desc``'s pool (one part per prefill rank; none
    given: one part of every head).

    Raises:
        WireError: parts that do not add up to the layout's KV heads.
    """
    split = desc.head_split or [layout["num_kv_heads"]]
    if sum(split) != layout["num_kv_heads"] or min(split) < 1:
        raise WireError(f"KV descriptor for {request_id} splits {layout['num_kv_heads']} KV heads as {split}")
    return split


def _check_layout(theirs: dict, ours: dict) -> None:
    # Peers may keep their caches in different dtypes: the blocks are converted on import.
    if _without_dtype(theirs) != _without_dtype(ours):
        raise ValueError(f"KV layout {theirs} does not match this worker's {ours}")


def _without_dtype(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k != "dtype"}
