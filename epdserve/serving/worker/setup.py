"""An engine worker's process set-up (``epdserve worker``): its options, parsed once into a
:class:`WorkerConfig`, the engine settings they give, the cores it is pinned to, where it runs (for its Hello), and what its role
loads (the model, the vision encoder, the engine and its shared KV pool, the other
tensor-parallel ranks: :mod:`epdserve.serving.worker.ranks`). The loop itself
is :mod:`epdserve.serving.worker.engine_worker`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from dataclasses import dataclass, fields, replace

import torch

from epdserve.argtypes import Options, config_from, float_above
from epdserve.engine.encoder import EncodeEngine
from epdserve.engine.config import DTYPES, EngineConfig, default_dtype
from epdserve.engine.engine import LLMEngine
from epdserve.model import linear, quant, tensor_parallel
from epdserve.model.config import ModelConfig
from epdserve.model.loader import ModelInfo, auto_dtype, resolve_model
from epdserve.model.vision import VisionConfig, read_config, vision_shard
from epdserve.serving import auth, flags
from epdserve.serving.deployment import ROLES
from epdserve.serving.worker.ranks import Ranks, split_cores
from epdserve.transfer import cuda_ipc, shm

log = logging.getLogger("epdserve.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``epdserve worker``'s options: its own, and the engine's shared with ``serve``
    (:mod:`epdserve.serving.flags`, one definition)."""
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--router", required=True, help="router events address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--bind", required=True, help="address for this worker's command socket")
    parser.add_argument("--worker-id", required=True)
    flags.MODEL_FLAG.add(parser)
    flags.CORES_FLAG.add(parser)
    flags.add_worker_flags(parser)
    parser.add_argument("--kv-ttl", type=float_above(0), default=120.0,
                        help="seconds a prefill worker keeps an exported KV segment nobody took")
    parser.add_argument("--kv-bind", default="tcp://127.0.0.1:0",
                        help="address a prefill (encode) worker serves KV (embeddings) on over TCP "
                             "(port 0: any free port)")
    parser.add_argument("--kv-transfer-timeout", type=float_above(0), default=30.0,
                        help="seconds a decode worker waits for a KV fetch over TCP")
    flags.ELASTIC_FLAG.add(parser)
    auth.add_arguments(parser)


@dataclass(frozen=True)
class WorkerConfig:
    """``epdserve worker``'s options: the engine's (``engine``, the flags its fields declare)
    and one field per other flag of :func:`add_arguments` (a test checks that every flag has
    its field: none is parsed and then ignored). Units as the flags': MiB, tokens, seconds."""
    role: str
    router: str
    bind: str
    worker_id: str
    model: str | None
    cores: str | None
    engine: EngineConfig
    tensor_parallel_size: int
    kv_transport: str
    kv_transfer_dtype: str
    kv_layer_pipeline: bool
    kv_ttl: float
    kv_bind: str
    kv_transfer_timeout: float
    elastic: bool
    auth_token: str | None
    allow_unauthenticated: bool
    internal_encryption: str

    @classmethod
    def from_args(cls, args: Options) -> WorkerConfig:
        return cls(engine=config_from(EngineConfig, args),
                   **{f.name: getattr(args, f.name) for f in fields(cls) if f.name != "engine"})


def weight_format(config: WorkerConfig, info: ModelInfo) -> str:
    """``--weight-format`` resolved for this worker (``model/linear.resolve``, after
    ``--dtype``): ``auto`` by what its role runs (an elastic worker may come to run either
    phase), checked against the model; an encode worker holds no language model and keeps
    the value as given.

    Raises:
        ValueError: a format the model, dtype or device cannot hold.
    """
    engine = config.engine
    if config.role == "encode":
        return engine.weight_format
    prefill = config.elastic or config.role in ("colocated", "prefill")
    decode = config.elastic or config.role in ("colocated", "decode")
    has_blocks = (engine.device == "cpu" and not info.multimodal and config.tensor_parallel_size == 1
                  and quant.usable(info.path))
    return linear.resolve(engine.weight_format, DTYPES[engine.dtype], has_blocks, prefill, decode).name


def check_model_split(config: WorkerConfig, info: ModelInfo) -> None:
    """Whether what ``config.role`` runs of ``info`` splits over ``config.tensor_parallel_size``
    ranks: the vision tower of an encode worker, else the language model in
    ``config.engine.weight_format`` (as given); on ``config.engine.device``. Nothing to check for one rank.

    Raises:
        ValueError: more ranks than the vision tower's attention heads
            (``vision.vision_shard``) or the language model's KV heads
            (``tensor_parallel.shard_ranges``), a format with GGUF blocks
            (``tensor_parallel.check_dense``), or on CUDA fewer GPUs from the worker's than
            ranks, or ``--kv-layer-pipeline`` on a worker that may prefill for another.
    """
    size, device, weights = config.tensor_parallel_size, config.engine.device, config.engine.weight_format
    if size == 1:
        return
    if config.role == "encode":
        vision_shard(VisionConfig.from_dict(read_config(info.path)), 0, size)
    else:
        tensor_parallel.shard_ranges(ModelConfig.from_dir(info.path), 0, size)
        if weights != "auto":
            tensor_parallel.check_dense(linear.parse(weights))
    if device.startswith("cuda"):
        if config.kv_layer_pipeline and (config.elastic or config.role == "prefill"):
            # Rank 0 would copy a layer off the other ranks' GPUs while they may still be writing it.
            raise ValueError(f"--kv-layer-pipeline with --tensor-parallel-size {size} on {device}: the "
                             "tensor-parallel ranks hand their KV over after the prefill step (leave the flag out)")
        first, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
        if first + size > count:
            raise ValueError(f"--tensor-parallel-size {size} on {device} needs GPUs "
                             f"{first}..{first + size - 1}, one a rank; this host has {count}")


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


def load(config: WorkerConfig):
    """Pin the cores and load what the role runs: ``(cores, model info, encode engine or
    None, engine and its shared KV pool or None, None for an encode worker, the other
    tensor-parallel ranks or None)``. With ``--tensor-parallel-size`` N > 1, this process is
    rank 0, pinned to its share of the cores (``ranks.split_cores``), and the followers are
    started on theirs (:class:`~epdserve.serving.worker.ranks.Ranks`; the caller closes them).

    Raises:
        ValueError, ModelLoadError, OSError: a bad option, model, or /dev/shm.
        RankFailure: a follower rank died or hung at start-up.
    """
    encode_role = config.role == "encode"
    cores = pin_to_cores(config.cores)
    if os.environ.get("EPDSERVE_NUM_THREADS"):  # a Ray actor: its CPU count, not the node's
        torch.set_num_threads(max(1, int(os.environ["EPDSERVE_NUM_THREADS"])))
    info = resolve_model(config.model)
    check_model_split(config, info)
    shares = split_cores(cores, config.tensor_parallel_size)
    engine_settings = config.engine
    if engine_settings.dtype is None:
        engine_settings = replace(engine_settings, dtype=default_dtype(engine_settings.device))
    elif engine_settings.dtype == "auto":
        engine_settings = replace(engine_settings, dtype=auto_dtype(info.path, engine_settings.weight_format,
                                                                    engine_settings.device))
        log.info("%s: --dtype auto: %s on %s", config.worker_id, engine_settings.dtype, engine_settings.device)
    config = replace(config, engine=engine_settings)
    config = replace(config, engine=replace(engine_settings, weight_format=weight_format(config, info)))
    encoder = engine = kv_pool = None
    ranks = _start_ranks(config, info, shares)
    try:
        if encode_role or (info.multimodal and (config.role in ("colocated", "prefill") or config.elastic)):
            # The ranks split an encode worker's vision tower; an engine worker's split its
            # language model, and the vision encoder it may hold runs whole on rank 0.
            encoder = EncodeEngine(info.path, DTYPES[config.engine.dtype], device=config.engine.device,
                                   tp=ranks if encode_role else None)
            if info.synthetic_vision:
                log.warning("%s: the vision tower of %s has SYNTHETIC (seeded random) weights: image outputs "
                            "carry no meaning", config.worker_id, info.name)
        if not encode_role:
            # A prefill worker keeps its KV cache where a same-host decode worker can read it, so a
            # hand-off copies it once: /dev/shm on the CPU, a CUDA-IPC-shared pool on a GPU
            # (docs/gpu-handoff.md). Converted or layer-pipelined KV is staged as a frame instead.
            exports = config.role == "prefill" or config.elastic  # an elastic worker may become a prefill worker
            shared = exports and config.kv_transfer_dtype == "none" and not config.kv_layer_pipeline
            engine, kv_pool = new_engine(str(info.path), config.engine, shared, tp=ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    return cores, info, encoder, engine, kv_pool, ranks


def _start_ranks(config: WorkerConfig, info: ModelInfo, shares: list[list[int]]) -> Ranks | None:
    """Pin this process, rank 0, to its share of the cores and start the follower ranks on
    theirs (with the vision tower's shards in an encode worker); None for one rank."""
    if config.tensor_parallel_size == 1:
        return None
    pin_to_cores(",".join(map(str, shares[0])))
    return Ranks.start(config.tensor_parallel_size, config.worker_id, str(info.path), config.engine.dtype,
                       config.engine.weight_format, config.engine.device, shares,
                       part="vision" if config.role == "encode" else "language")


def new_engine(model_dir: str, config: EngineConfig, shared_pool: bool, ipc_backend: cuda_ipc.IpcBackend | None = None,
               tp: Ranks | None = None) -> tuple[LLMEngine, shm.KVPool | cuda_ipc.DevicePool | None]:
    """An engine and, with ``shared_pool``, the pool its KV cache lives in (for an
    :class:`Exporter` that hands blocks over without copying them): a
    :class:`~epdserve.transfer.shm.KVPool` for a cache in host memory, a
    :class:`~epdserve.transfer.cuda_ipc.DevicePool` for one on a GPU (or on the CPU with a
    test's ``ipc_backend``, e.g. :class:`~epdserve.transfer.cuda_ipc.FakeBackend`). The
    pool's file is deleted by :meth:`Exporter.close` or, failing that, at interpreter exit.

    With ``tp`` (a tensor-parallel worker's ranks), the ranks' pool holds the cache
    (:meth:`Ranks.drive`: one part per rank, in /dev/shm on the CPU) and is the one shared;
    on CUDA there is none (each rank's part is on its GPU): the KV leaves as staged frames.

    Raises:
        as :class:`LLMEngine`; ``OSError`` when /dev/shm cannot hold the pool (or its
        tags); :class:`~epdserve.transfer.cuda_ipc.IpcError` when a GPU cache cannot be
        shared.
    """
    if tp is not None:
        engine = LLMEngine(model_dir, config, tp=tp)
        return engine, tp.pool if shared_pool else None
    if not shared_pool:
        return LLMEngine(model_dir, config), None
    pools: list[shm.KVPool | cuda_ipc.DevicePool] = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if ipc_backend is not None or device.type == "cuda":
            pools.append(cuda_ipc.DevicePool(shape, dtype, device, ipc_backend))
        else:
            pools.append(shm.KVPool(shape, dtype))
        return pools[-1].parts[0]

    return LLMEngine(model_dir, config, kv_allocator=allocate), pools[0]
