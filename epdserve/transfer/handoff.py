"""One request's KV from a prefill worker (:class:`Exporter`) to a decode worker (:class:`Importer`): held
pool blocks (/dev/shm or CUDA IPC) or a staged /dev/shm frame, either fetched over TCP across hosts. Paths,
ownership and release: docs/architecture.md (PD) and docs/gpu-handoff.md."""

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
    """Shared by exactly the processes that can map each other's /dev/shm and reach each other's 127.0.0.1:
    machine id (or host name), /dev/shm's device and inode, and the network namespace (containers differ)."""
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
    """``bind``: ``tcp://HOST:PORT`` (port 0: any) to serve KV on, or None. ``pool``: the shared pool holding
    ``engine.kv_cache``, or None. With ``layer_pipeline``, requests to export pass ``layer_sink`` to ``add_request``.
    Raises zmq.ZMQError (bind), ValueError (unknown ``transfer_dtype``, or a pool not holding the cache)."""

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
        """Keep ``out.kv_block_ids`` held and tagged, or stage them (ending the engine's hold); adds ``kv_export_ms``,
        ``kv_bytes`` and, pipelined, ``kv_layer_copy_ms`` to ``out.timings``. Raises OSError (/dev/shm)."""
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
        """The KV server's source, on its thread: a held request's frame built now, or its segment (unlinked)."""
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
        """If still held; see :meth:`ExportTable.release`."""
        self.table.release(request_id)

    def expire(self) -> list[str]:
        """Returns the expired request ids; also deletes pipelined frames of requests no longer running."""
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
    """``transport``: "auto" (same-host shared memory or CUDA IPC, else TCP), "shm" or "tcp". Pools stay mapped
    until their file is gone. :meth:`take` and :meth:`fetch_frame` are thread-safe and never touch an engine."""

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
        """A ``KVSource`` of ``[layers, 2, n_blocks, block_size, kv_heads, head_dim]`` in ``dtype`` (frames moved to
        ``device`` first, so int8 is dequantized there) and timings ``kv_fetch_ms``, ``kv_tcp`` (1.0 or 0.0). Blocks up
        to ``timeout_s`` on TCP, or until ``cancel``. Raises WireError (KV gone, unreachable, malformed or refused;
        IpcError: a bad CUDA IPC handle or a dead exporter) and ValueError (another KV layout, dtype aside)."""
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
        """A same-host pool the transport allows; a GPU pool this process cannot open goes over TCP under "auto"."""
        if desc.kind == "shm" or self.uses_tcp(desc) or desc.host_id != self.host:
            return False
        return handle is None or self.transport != "auto" or desc.addr is None or self.ipc.can_open(handle)

    def uses_tcp(self, desc: KVDescriptor) -> bool:
        """Whether what ``desc`` describes comes over TCP (else from this host's /dev/shm)."""
        return self.transport == "tcp" or (self.transport == "auto" and desc.host_id != self.host)

    def _over_tcp(self, desc: KVDescriptor) -> bool:
        """Also a GPU pool's blocks: their frame exists only as the TCP reply."""
        return self.uses_tcp(desc) or desc.kind == "cuda_ipc"

    def fetch_frame(self, request_id: str, desc: KVDescriptor,
                    cancel: threading.Event | None = None) -> tuple[TensorHeader, dict[str, torch.Tensor]]:
        """A staged frame, embeddings, or a pool's blocks as one frame: mapped and unlinked on this host, else over
        TCP. Raises WireError as :meth:`take`."""
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
    """Raises WireError unless the runs cover the tokens inside the pool and a tag is named."""
    num_blocks = -(-desc.num_tokens // block_size)
    runs = desc.block_runs
    if (desc.num_tokens < 1 or desc.tag < 1 or sum(n for _, n in runs) != num_blocks
            or any(first < 0 or n < 1 or first + n > pool_blocks for first, n in runs)):
        shown = f"{runs[:4]}{'...' if len(runs) > 4 else ''}"
        raise WireError(f"KV descriptor for {request_id} is invalid: blocks {shown} for {desc.num_tokens} "
                        f"tokens in a pool of {pool_blocks} blocks, tag {desc.tag}")


def _head_split(request_id: str, desc: KVDescriptor, layout: dict) -> list[int]:
    """The KV heads of each rank's part (none given: one part). Raises WireError if they do not add up."""
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
