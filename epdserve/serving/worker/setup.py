"""An engine worker's process set-up (``epdserve worker``): its options (:class:`WorkerConfig`), its cores, and
what its role loads; the loop is :mod:`epdserve.serving.worker.engine_worker`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from dataclasses import dataclass, field, replace

import torch

from epdserve.argtypes import add_flags, config_from, field_of, flags_of, float_above, int_at_least, nested, setting
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
from epdserve.transfer import cuda_ipc, handoff, kv_codec, shm

log = logging.getLogger("epdserve.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """Units as the flags': MiB, tokens, seconds. ``passed`` fields are those serve passes to each worker."""
    role: str = field(metadata=setting("the worker's role", choices=ROLES, required=True))
    router: str = field(metadata=setting("router events address, e.g. tcp://127.0.0.1:5555", required=True))
    bind: str = field(metadata=setting("address for this worker's command socket", required=True))
    worker_id: str = field(metadata=setting("the worker's name, unique in its deployment", required=True))
    model: str | None = field_of(flags.MODEL_FLAG)
    cores: str | None = field_of(flags.CORES_FLAG)
    engine: EngineConfig = nested(EngineConfig, passed=True)
    tensor_parallel_size: int = field(default=1, metadata=setting(
        "ranks of one engine worker (vLLM's flag), each a process with its share of the model's heads, MLP "
        "columns and vocabulary and of the KV cache; the worker's cores are split among them and its steps run on "
        "all of them (docs/tensor-parallel.md); any engine role (KV handed over between any two sizes); an encode "
        "worker (serve's --encode-tp) splits its vision tower; dense weights (auto: the dense copy)",
        "--tensor-parallel-size", "-tp", type=int_at_least(1), passed=True))
    kv_transport: str = field(default="auto", metadata=setting(
        "KV hand-off: shared memory on the same host, TCP otherwise (auto), or one of them",
        choices=handoff.TRANSPORTS, passed=True))
    kv_transfer_dtype: str = field(default="none", metadata=setting(
        "how a prefill worker sends KV: as cached, bf16, or int8 with per-token, per-head scales",
        choices=kv_codec.TRANSFER_DTYPES, passed=True))
    kv_layer_pipeline: bool = field(default=False, metadata=setting(
        "a prefill worker writes each layer's KV into the outgoing frame as soon as the layer is computed (a "
        "staged frame instead of its shared KV pool)", action="store_true", passed=True))
    kv_ttl: float = field(default=120.0, metadata=setting(
        "seconds a prefill worker keeps an exported KV segment nobody took", type=float_above(0)))
    kv_bind: str = field(default="tcp://127.0.0.1:0", metadata=setting(
        "address a prefill (encode) worker serves KV (embeddings) on over TCP (port 0: any free port)"))
    kv_transfer_timeout: float = field(default=30.0, metadata=setting(
        "seconds a decode worker waits for a KV fetch over TCP", type=float_above(0)))
    elastic: bool = field_of(flags.ELASTIC_FLAG)
    auth: auth.AuthOptions = nested(auth.AuthOptions)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkerConfig:
        return config_from(cls, args)


WORKER_FLAGS = flags_of(WorkerConfig, passed=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerConfig)


def worker_argv(given: dict[str, object]) -> list[str]:
    """Values by dest of :data:`WORKER_FLAGS` and ``--model`` (None or absent: not given) as worker argv words."""
    return [word for flag in (flags.MODEL_FLAG, *WORKER_FLAGS) for word in flag.argv(given.get(flag.dest))]


def worker_default(dest: str):
    return next(f.kwargs.get("default") for f in WORKER_FLAGS if f.dest == dest)


def weight_format(config: WorkerConfig, info: ModelInfo) -> str:
    """``--weight-format`` resolved: ``auto`` by what the role runs (elastic: both phases); an encode worker
    keeps it as given. Raises ValueError: a format the model, dtype or device cannot hold."""
    engine = config.engine
    if config.role == "encode":
        return engine.weight_format
    prefill = config.elastic or config.role in ("colocated", "prefill")
    decode = config.elastic or config.role in ("colocated", "decode")
    has_blocks = (engine.device == "cpu" and not info.multimodal and config.tensor_parallel_size == 1
                  and quant.usable(info.path))
    return linear.resolve(engine.weight_format, DTYPES[engine.dtype], has_blocks, prefill, decode).name


def check_model_split(config: WorkerConfig, info: ModelInfo) -> None:
    """Whether the role's part (an encode worker's vision tower, else the language model) splits over the
    ranks. Raises ValueError: more ranks than attention (KV) heads, a GGUF-block format, on CUDA fewer GPUs than
    ranks, or ``--kv-layer-pipeline`` on a worker that may prefill for another."""
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
    """Pins this process and torch's thread count to ``spec`` ("0,1"). Raises ValueError: a bad or unavailable core."""
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
    """For the Hello: ``node_id``, ``node_ip``, ``resources`` from the ``$EPDSERVE_NODE_*`` a Ray actor sets
    (else the host name, "" and {}), and ``pid``."""
    try:
        resources = json.loads(os.environ.get("EPDSERVE_NODE_RESOURCES") or "{}")
    except json.JSONDecodeError:
        resources = {}
    return {"node_id": os.environ.get("EPDSERVE_NODE_ID") or socket.gethostname(),
            "node_ip": os.environ.get("EPDSERVE_NODE_IP", ""), "resources": resources, "pid": os.getpid()}


def load(config: WorkerConfig):
    """``(cores, info, encoder, engine, KV pool, ranks)``, None where the role has none; the caller closes ``ranks``
    (tensor-parallel: this process is rank 0). Raises ValueError, ModelLoadError, OSError (a bad option, model or
    /dev/shm), RankFailure (a follower rank died or hung at start-up)."""
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
            # an engine worker's vision encoder runs whole on rank 0
            encoder = EncodeEngine(info.path, DTYPES[config.engine.dtype], device=config.engine.device,
                                   tp=ranks if encode_role else None)
            if info.synthetic_vision:
                log.warning("%s: the vision tower of %s has SYNTHETIC (seeded random) weights: image outputs "
                            "carry no meaning", config.worker_id, info.name)
        if not encode_role:
            # Shared so that a same-host hand-off copies it once (/dev/shm, or CUDA IPC: docs/gpu-handoff.md);
            # converted or layer-pipelined KV goes as staged frames.
            exports = config.role == "prefill" or config.elastic
            shared = exports and config.kv_transfer_dtype == "none" and not config.kv_layer_pipeline
            engine, kv_pool = new_engine(str(info.path), config.engine, shared, tp=ranks)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    return cores, info, encoder, engine, kv_pool, ranks


def _start_ranks(config: WorkerConfig, info: ModelInfo, shares: list[list[int]]) -> Ranks | None:
    if config.tensor_parallel_size == 1:
        return None
    pin_to_cores(",".join(map(str, shares[0])))
    return Ranks.start(config.tensor_parallel_size, config.worker_id, str(info.path), config.engine.dtype,
                       config.engine.weight_format, config.engine.device, shares,
                       part="vision" if config.role == "encode" else "language")


def new_engine(model_dir: str, config: EngineConfig, shared_pool: bool, ipc_backend: cuda_ipc.IpcBackend | None = None,
               tp: Ranks | None = None) -> tuple[LLMEngine, shm.KVPool | cuda_ipc.DevicePool | None]:
    """With ``shared_pool``, also the pool its KV cache lives in (handed over without a copy): ``shm.KVPool`` in
    host memory, ``cuda_ipc.DevicePool`` on a GPU (or with a test's ``ipc_backend``); deleted by ``Exporter.close``
    or at interpreter exit. With ``tp``, the ranks' pool (none on CUDA: staged frames). Raises as :class:`LLMEngine`;
    OSError: /dev/shm cannot hold the pool; ``cuda_ipc.IpcError``: a GPU cache cannot be shared."""
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
