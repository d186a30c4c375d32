"""GPU-only checks of the CUDA IPC hand-off (:mod:`epdserve.transfer.cuda_ipc`), for a
session with a GPU (``tests/test_cuda_ipc.py``'s ``cuda`` tests, ``benchmarks/gpu_check.py``).
The exporter runs in a spawned process that imports this module by name, so importing it
puts ``benchmarks/`` on ``sys.path`` (the spawned child gets the parent's).

* :func:`exporter_process`: a prefill side in a process of its own (spawned, as CUDA
  requires) that shares a :class:`~epdserve.transfer.cuda_ipc.DevicePool` and sends its
  packed handle over a pipe as bytes (no pickled tensors, no torch.multiprocessing
  reductions);
* :func:`two_process_check`: open that handle here, copy some blocks into a cache of this
  process, and report whether they are bit-equal, whether a copy after the exporter's
  release is refused, and whether the opened memory is freed once the importer closes it;
* :func:`ipc_copy_benchmark`: the KV of an ``num_tokens`` prompt copied from the other
  process's pool by CUDA IPC (the decode side's real import:
  :meth:`~epdserve.transfer.pooled.PooledKV.copy_into`, its tag checks and stream wait
  included) against a device-to-device copy of the same bytes inside one process.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from epdserve.engine.kv_parts import KVParts
from epdserve.transfer import cuda_ipc
from epdserve.transfer.pooled import PooledKV, wait_for_copies
from epdserve.transfer.wire import WireError

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

# Llama-3.1-8B's KV blocks (32 layers, 8 KV heads of 128, bf16) in 16-token blocks: 128 KiB per token.
LLAMA_8B_LAYOUT = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"}
_SMALL_LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "dtype": "bfloat16"}
_TAG = 1  # the exporter's tag on every block, as one held export


def seeded_kv(shape: list[int], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Normal values of ``shape`` in ``dtype`` on ``device`` from ``seed``: the same bits
    in every process on the same kind of GPU."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)


def export_child(conn, shape: list[int], dtype_name: str, device: str, seed: int | None) -> None:
    """Child process body: a pool of ``shape`` on ``device`` (filled from ``seed``, or
    zeros), every block tagged as held, its handle sent as bytes; then, until ``b"stop"``,
    ``b"release"`` clears the tags (as a release does) and answers ``b"released"``."""
    dtype = cuda_ipc.KV_DTYPES[dtype_name]
    pool = cuda_ipc.DevicePool(tuple(shape), dtype, device)
    try:
        if seed is not None:
            pool.kv.copy_(seeded_kv(shape, dtype, device, seed))
        torch.cuda.synchronize(device)  # the contents are there before the handle goes out
        pool.tags.fill_(_TAG)
        conn.send_bytes(pool.handle_bytes)
        while (command := conn.recv_bytes()) != b"stop":
            if command == b"release":
                pool.tags.zero_()
                conn.send_bytes(b"released")
    finally:
        pool.close()


@contextlib.contextmanager
def exporter_process(shape: list[int], dtype_name: str = "bfloat16", device: str = "cuda:0",
                     seed: int | None = None, timeout_s: float = 120.0) -> Iterator[tuple]:
    """Run :func:`export_child` in a spawned process; yields ``(process, pipe, handle)``
    and stops the process on exit.

    Raises:
        RuntimeError: no handle within ``timeout_s``, or the child exited (see its stderr).
        IpcError: a handle that does not validate.
    """
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=export_child, args=(theirs, list(shape), dtype_name, device, seed), daemon=True)
    proc.start()
    theirs.close()  # the child's end: a child that dies then reads as end of file here, at once
    try:
        if not ours.poll(timeout_s):
            raise RuntimeError(f"the exporter process sent no CUDA IPC handle within {timeout_s:g} s")
        try:
            data = ours.recv_bytes()
        except EOFError:
            raise RuntimeError("the exporter process exited without a CUDA IPC handle (see its stderr)") from None
        yield proc, ours, cuda_ipc.unpack_handle(data)
    finally:
        with contextlib.suppress(OSError):
            ours.send_bytes(b"stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def two_process_check(device: str = "cuda:0", decode_device: str | None = None, seed: int = 1234) -> dict:
    """Blocks 2, 3 and 5 of a seeded pool in another process, opened here by CUDA IPC and
    copied into blocks 0-2 of a cache on ``decode_device`` (default ``device``). Returns
    ``{"bit_equal", "refused_after_release", "closed"}`` (bools): the copy equals the
    exporter's blocks bit for bit; a copy after the exporter cleared the tags raises;
    once the importer closed the pool no tensor here views the opened memory (torch's
    deleter then closed the handle)."""
    from torch.multiprocessing.reductions import StorageWeakRef  # a weak reference only: nothing is reduced

    shape = [2, 2, 8, 16, 2, 64]
    dtype = cuda_ipc.KV_DTYPES[_SMALL_LAYOUT["dtype"]]
    with exporter_process(shape, _SMALL_LAYOUT["dtype"], device, seed) as (_, conn, handle):
        importer = cuda_ipc.IpcImporter()
        pool, tags = importer.open(handle, _SMALL_LAYOUT)
        opened = StorageWeakRef(pool.untyped_storage())
        cache = torch.zeros(shape, dtype=dtype, device=decode_device or device)
        kv = PooledKV("check", KVParts([pool]), tags, [(2, 2), (5, 1)], _TAG, dtype,
                      functools.partial(cuda_ipc.exporter_alive, handle))
        kv.copy_into(KVParts([cache]), [0, 1, 2])
        expected = seeded_kv(shape, dtype, device, seed)[:, :, [2, 3, 5]].to(cache.device)
        bit_equal = torch.equal(cache[:, :, :3].view(torch.int16), expected.view(torch.int16))
        conn.send_bytes(b"release")
        conn.recv_bytes()
        try:
            kv.copy_into(KVParts([cache]), [0, 1, 2])
            refused = False
        except WireError:
            refused = True
        del kv, pool, tags
        importer.close(handle.pool_id)
        gc.collect()
        closed = opened.expired() and not importer.open_ids()
    return {"bit_equal": bit_equal, "refused_after_release": refused, "closed": closed}


def _median_ms(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: first-touch mappings, peer access, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def ipc_copy_benchmark(num_tokens: int, layout: dict = LLAMA_8B_LAYOUT, device: str = "cuda:0",
                       decode_device: str | None = None, repeats: int = 20) -> dict:
    """The KV of an ``num_tokens`` prompt of ``layout`` copied by CUDA IPC from a pool in
    another process on ``device`` into a cache here on ``decode_device`` (default the same
    GPU), against a device-to-device copy of the same bytes with the same strides inside
    this process (the ceiling the IPC copy is measured against).

    Returns ``{"num_tokens", "kv_bytes", "ipc_ms", "ipc_gbps", "d2d_ms", "d2d_gbps",
    "ipc_vs_d2d"}``: ms are medians over ``repeats`` (after one warm-up), each including
    the wait for the copy to end (and, for IPC, the tag checks before and after); GB/s =
    ``kv_bytes`` / time / 1e9, bytes copied once (each is read and written once);
    ``ipc_vs_d2d`` = ipc_gbps / d2d_gbps (goal: >= 0.5, docs/gpu-handoff.md).

    Raises:
        RuntimeError, IpcError: as :func:`exporter_process`; torch's errors without a GPU.
    """
    dtype = cuda_ipc.KV_DTYPES[layout["dtype"]]
    blocks = -(-num_tokens // layout["block_size"])
    shape = [layout["num_layers"], 2, blocks, layout["block_size"], layout["num_kv_heads"], layout["head_dim"]]
    target = decode_device or device
    with exporter_process(shape, layout["dtype"], device) as (_, _, handle):
        importer = cuda_ipc.IpcImporter()
        pool, tags = importer.open(handle, layout)
        cache = torch.empty(shape, dtype=dtype, device=target)
        alive = functools.partial(cuda_ipc.exporter_alive, handle)
        kv = PooledKV("bench", KVParts([pool]), tags, [(0, blocks)], _TAG, dtype, alive)
        ipc_ms = _median_ms(lambda: kv.copy_into(KVParts([cache]), list(range(blocks))), repeats)
        local = torch.zeros(shape, dtype=dtype, device=device)

        def d2d() -> None:
            cache.copy_(local)
            wait_for_copies(local, cache)

        d2d_ms = _median_ms(d2d, repeats)
        del kv, pool, tags
        importer.close()
    kv_bytes = cache.nbytes
    ipc_gbps, d2d_gbps = kv_bytes / ipc_ms / 1e6, kv_bytes / d2d_ms / 1e6
    return {"num_tokens": num_tokens, "kv_bytes": kv_bytes, "ipc_ms": ipc_ms, "ipc_gbps": ipc_gbps,
            "d2d_ms": d2d_ms, "d2d_gbps": d2d_gbps, "ipc_vs_d2d": ipc_gbps / d2d_gbps}
