"""An engine worker's process set-up (``epdserve worker``): its options, the engine settings
they give, the cores it is pinned to, where it runs (for its Hello), and what its role
loads (the model, the vision encoder, the engine and its shared KV pool). The loop itself
is :mod:`epdserve.serving.worker.engine_worker`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket

import torch

from epdserve.argtypes import float_above
from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.engine import DTYPES, EngineConfig, LLMEngine
from epdserve.model.loader import auto_dtype, resolve_model
from epdserve.serving import auth, flags
from epdserve.serving.deployment import ENGINE_ROLES
from epdserve.transfer import cuda_ipc, shm

log = logging.getLogger("epdserve.worker")
ROLES = ENGINE_ROLES  # an encode worker runs EncodeWorker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``epdserve worker``'s options: its own, and the engine's shared with ``serve``
    (:mod:`epdserve.serving.flags`, one definition)."""
    parser.add_argument("--role", choices=ROLES + ("encode",), required=True)
    parser.add_argument("--router", required=True, help="router events address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--bind", required=True, help="address for this worker's command socket")
    parser.add_argument("--worker-id", required=True)
    flags.MODEL_FLAG.add(parser)
    parser.add_argument("--cores", default=None, help="CPU cores to pin to, e.g. 0,1 (default: all allowed)")
    flags.add_worker_flags(parser)
    parser.add_argument("--kv-ttl", type=float_above(0), default=120.0,
                        help="seconds a prefill worker keeps an exported KV segment nobody took")
    parser.add_argument("--kv-bind", default="tcp://127.0.0.1:0",
                        help="address a prefill (encode) worker serves KV (embeddings) on over TCP "
                             "(port 0: any free port)")
    parser.add_argument("--kv-transfer-timeout", type=float_above(0), default=30.0,
                        help="seconds a decode worker waits for a KV fetch over TCP")
    parser.add_argument("--elastic", action="store_true",
                        help="the router may switch this worker's role live (colocated, prefill, decode): keep "
                             "the KV cache shareable and serve KV whatever the role (docs/elastic.md)")
    auth.add_arguments(parser, "shared secret that seals every frame between this worker, the router and the "
                               "other workers (default: $EPDSERVE_AUTH_TOKEN)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings of a worker's options (``--dtype auto`` resolved first, see :func:`_load`)."""
    return EngineConfig(block_size=args.block_size, kv_cache_memory_mb=args.kv_cache_memory_mb,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=args.enable_chunked_prefill,
                        enable_prefix_caching=args.enable_prefix_caching, dtype=args.dtype,
                        quantized_weights=args.quantized_weights, device=args.device,
                        cuda_graph=not args.enforce_eager)


def pin_to_cores(spec: str | None) -> list[int]:
    """Pin this process (and torch's thread pool) to ``spec`` ("0,1"); returns the cores.

    Raises:
        ValueError: a core that is not a number or not available to this process.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if spec is None:
        cores = allowed
    else:
        try:
            cores = sorted({int(c) for c in spec.split(",")})
        except ValueError:
            raise ValueError(f"--cores {spec!r}: expected comma-separated core numbers") from None
        if not set(cores) <= set(allowed):
            raise ValueError(f"--cores {spec!r}: available cores are {allowed}")
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores


def node_identity() -> dict:
    """Where this worker runs, for its Hello: ``node_id``, ``node_ip`` and ``resources``
    from ``$EPDSERVE_NODE_ID`` / ``$EPDSERVE_NODE_IP`` / ``$EPDSERVE_NODE_RESOURCES`` (JSON),
    which a Ray actor sets (``epdserve.serving.launch.ray_cluster``); else the host name, "" and {};
    and ``pid``, this process."""
    try:
        resources = json.loads(os.environ.get("EPDSERVE_NODE_RESOURCES") or "{}")
    except json.JSONDecodeError:
        resources = {}
    return {"node_id": os.environ.get("EPDSERVE_NODE_ID") or socket.gethostname(),
            "node_ip": os.environ.get("EPDSERVE_NODE_IP", ""), "resources": resources, "pid": os.getpid()}


def load(args: argparse.Namespace):
    """Pin the cores and load what the role runs: ``(cores, model info, encode engine or
    None, engine and its shared KV pool or None, None for an encode worker)``.

    Raises:
        ValueError, ModelLoadError, OSError: a bad option, model, or /dev/shm.
    """
    encode_role = args.role == "encode"
    cores = pin_to_cores(args.cores)
    if os.environ.get("EPDSERVE_NUM_THREADS"):  # a Ray actor: its CPU count, not the node's
        torch.set_num_threads(max(1, int(os.environ["EPDSERVE_NUM_THREADS"])))
    info = resolve_model(args.model)
    if args.dtype is None:  # bfloat16 on CUDA (as vLLM), float32 on the CPU (as before the GPU path)
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    elif args.dtype == "auto":
        args.dtype = auto_dtype(info.path, args.quantized_weights, args.device)
        log.info("%s: --dtype auto: %s on %s", args.worker_id, args.dtype, args.device)
    encoder = engine = kv_pool = None
    if encode_role or (info.multimodal and (args.role in ("colocated", "prefill") or args.elastic)):
        encoder = EncodeEngine(info.path, DTYPES[args.dtype], device=args.device)
        if info.synthetic_vision:
            log.warning("%s: the vision tower of %s has SYNTHETIC (seeded random) weights: image outputs "
                        "carry no meaning", args.worker_id, info.name)
    if not encode_role:
        # A prefill worker keeps its KV cache where a same-host decode worker can read it, so a
        # hand-off copies it once: /dev/shm on the CPU, a CUDA-IPC-shared pool on a GPU
        # (docs/gpu-handoff.md). Converted or layer-pipelined KV is staged as a frame instead.
        exports = args.role == "prefill" or args.elastic  # an elastic worker may become a prefill worker
        shared = exports and args.kv_transfer_dtype == "none" and not args.kv_layer_pipeline
        engine, kv_pool = new_engine(str(info.path), engine_config(args), shared)
    return cores, info, encoder, engine, kv_pool


def new_engine(model_dir: str, config: EngineConfig, shared_pool: bool, ipc_backend: cuda_ipc.IpcBackend | None = None
               ) -> tuple[LLMEngine, shm.KVPool | cuda_ipc.DevicePool | None]:
    """An engine and, with ``shared_pool``, the pool its KV cache lives in (for an
    :class:`Exporter` that hands blocks over without copying them): a
    :class:`~epdserve.transfer.shm.KVPool` for a cache in host memory, a
    :class:`~epdserve.transfer.cuda_ipc.DevicePool` for one on a GPU (or on the CPU with a
    test's ``ipc_backend``, e.g. :class:`~epdserve.transfer.cuda_ipc.FakeBackend`). The
    pool's file is deleted by :meth:`Exporter.close` or, failing that, at interpreter exit.

    Raises:
        as :class:`LLMEngine`; ``OSError`` when /dev/shm cannot hold the pool (or its
        tags); :class:`~epdserve.transfer.cuda_ipc.IpcError` when a GPU cache cannot be
        shared.
    """
    if not shared_pool:
        return LLMEngine(model_dir, config), None
    pools: list[shm.KVPool | cuda_ipc.DevicePool] = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if ipc_backend is not None or device.type == "cuda":
            pools.append(cuda_ipc.DevicePool(shape, dtype, device, ipc_backend))
        else:
            pools.append(shm.KVPool(shape, dtype))
        return pools[-1].kv

    return LLMEngine(model_dir, config, kv_allocator=allocate), pools[0]
