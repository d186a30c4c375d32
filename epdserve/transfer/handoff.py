"""One request's KV blocks from a prefill worker to a decode worker, end to end.

The prefill side (:class:`Exporter`) always writes the blocks (converted as
``--kv-transfer-dtype`` says, see :mod:`epdserve.transfer.kv_codec`) as one wire frame to
/dev/shm and, unless the transport is ``shm``, also serves that frame over TCP
(:class:`epdserve.transfer.tcp.KVServer`). Its :class:`~epdserve.serving.protocol.KVDescriptor`
names the segment, the host it lies on (:func:`host_id`) and the TCP address. The decode
side (:class:`Importer`) maps the segment when it lies on its own host and the transport
allows it, and fetches it over TCP otherwise (transport ``auto``, the default), and
converts the blocks to its own cache dtype, which may differ from the prefill side's.

The prefill side owns a segment until the decode side takes it (mapping and TCP serving
both unlink it), the router releases it, or its TTL passes.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from pathlib import Path

import torch
import zmq

from epdserve.engine.engine import LLMEngine, StepOutput
from epdserve.serving.protocol import KVDescriptor
from epdserve.transfer import kv_codec, shm, tcp
from epdserve.transfer.wire import TensorHeader, WireError

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
    """Prefill side. ``bind``: the TCP address to serve frames on (``tcp://HOST:PORT``,
    port 0 = any free one), or None for shared memory only. ``ttl_s``: seconds a segment
    nobody took is kept. ``transfer_dtype``: one of ``kv_codec.TRANSFER_DTYPES``.

    Raises (constructor): ``zmq.ZMQError`` if ``bind`` cannot be bound; ``ValueError``
    for an unknown ``transfer_dtype``.
    """

    def __init__(self, engine: LLMEngine, ttl_s: float, ctx: zmq.Context, bind: str | None,
                 transfer_dtype: str = "none"):
        if transfer_dtype not in kv_codec.TRANSFER_DTYPES:
            raise ValueError(f"unknown KV transfer dtype {transfer_dtype!r}")
        self.engine = engine
        self.ttl_s = ttl_s
        self.transfer_dtype = transfer_dtype
        self.host = host_id()
        self.segments: dict[str, tuple[str, float]] = {}  # request id -> (segment, created)
        self.server = tcp.KVServer(ctx, bind, self._owns) if bind else None

    def _owns(self, request_id: str, name: str) -> bool:
        # Runs on the server thread; one dict lookup is atomic under the GIL.
        return self.segments.get(request_id, ("", 0.0))[0] == name

    def export(self, out: StepOutput) -> KVDescriptor:
        """Copy the blocks ``out.kv_block_ids`` into a new segment, free them in the engine,
        and describe the segment. Adds ``kv_export_ms`` and ``kv_bytes`` to ``out.timings``.

        Raises:
            OSError: /dev/shm is full or not writable.
        """
        start = time.perf_counter()
        ids = out.kv_block_ids
        layout = self.engine.kv_layout()
        shape = list(self.engine.kv_cache.shape)
        shape[2] = len(ids)
        header = TensorHeader(tensors=kv_codec.specs(shape, self.engine.kv_cache.dtype, self.transfer_dtype),
                              layout=layout, num_tokens=len(ids) * layout["block_size"])

        def fill(views: dict[str, torch.Tensor]) -> None:
            if "scales" in views:
                kv_codec.encode(self.engine.read_kv(ids), views)
            else:  # none, bf16: straight from the cache into the frame, one (casting) copy
                self.engine.read_kv(ids, out=views["kv"])

        name = shm.new_name()
        nbytes = shm.write(name, header, fill)
        self.engine.release_kv(out.request_id)
        self.segments[out.request_id] = (name, time.monotonic())
        out.timings["kv_export_ms"] = (time.perf_counter() - start) * 1e3
        out.timings["kv_bytes"] = float(nbytes)
        return KVDescriptor(name=name, num_tokens=header.num_tokens, nbytes=nbytes, host_id=self.host,
                            addr=self.server.addr if self.server else None)

    def release(self, request_id: str) -> None:
        """Delete the request's segment if it still exists (taken, abort, TTL)."""
        name, _ = self.segments.pop(request_id, (None, 0.0))
        if name is not None:
            shm.remove(name)

    def expire(self) -> list[str]:
        """Release every segment older than the TTL; returns their request ids."""
        now = time.monotonic()
        old = [rid for rid, (_, created) in self.segments.items() if now - created > self.ttl_s]
        for request_id in old:
            self.release(request_id)
        return old

    def close(self) -> None:
        """Stop serving and delete every segment still held."""
        if self.server is not None:
            self.server.close()
        for request_id in list(self.segments):
            self.release(request_id)


class Importer:
    """Decode side. ``transport``: "auto" (shared memory on the same host, else TCP),
    "shm" or "tcp". ``timeout_s``: the longest a TCP fetch may take."""

    def __init__(self, ctx: zmq.Context, transport: str, timeout_s: float):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown KV transport {transport!r} (choose from {', '.join(TRANSPORTS)})")
        self.ctx = ctx
        self.transport = transport
        self.timeout_s = timeout_s
        self.host = host_id()

    def take(self, request_id: str, desc: KVDescriptor, layout: dict,
             dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, float]]:
        """Get the KV blocks ``desc`` describes as a tensor ``[layers, 2, n_blocks,
        block_size, kv_heads, head_dim]`` of ``dtype``, and timings ``kv_fetch_ms`` (ms,
        fetch or map plus conversion) and ``kv_tcp`` (1.0 if it came over TCP, else 0.0).
        Blocks up to ``timeout_s`` on TCP.

        Raises:
            WireError: the segment is gone, unreachable, malformed, on another host while
                the transport is "shm", or without a TCP address while TCP is needed.
            ValueError: its KV layout differs from ``layout`` (in anything but the dtype).
        """
        start = time.perf_counter()
        use_tcp = self.transport == "tcp" or (self.transport == "auto" and desc.host_id != self.host)
        if use_tcp:
            if desc.addr is None:
                raise WireError("the KV lies on another host and its prefill worker serves no TCP address")
            header, tensors = tcp.fetch(self.ctx, desc.addr, request_id, desc.name, desc.nbytes, self.timeout_s)
        else:
            if desc.host_id != self.host:
                raise WireError("the KV lies on another host and --kv-transport is shm")
            header, tensors = shm.read(desc.name)
        if _without_dtype(header.layout) != _without_dtype(layout):
            raise ValueError(f"KV layout {header.layout} does not match this worker's {layout}")
        kv = kv_codec.decode(tensors, dtype)
        return kv, {"kv_fetch_ms": (time.perf_counter() - start) * 1e3, "kv_tcp": float(use_tcp)}


def _without_dtype(layout: dict) -> dict:
    # Peers may keep their caches in different dtypes: the blocks are converted on import.
    return {k: v for k, v in layout.items() if k != "dtype"}
