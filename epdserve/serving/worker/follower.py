"""A follower rank's process of a tensor-parallel worker (``python -m epdserve.serving.worker.follower``,
started by :class:`~epdserve.serving.worker.ranks.Ranks`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from epdserve.engine import runner
from epdserve.engine.config import DTYPES
from epdserve.model.llama import LlamaModel
from epdserve.model.loader import load_language_model
from epdserve.model.tensor_parallel import TPRank
from epdserve.model.vision import VisionEncoder
from epdserve.serving.worker import rank_messages as M
from epdserve.serving.worker.ranks import COLLECTIVE_TIMEOUT_S, PARTS, POLL_S
from epdserve.transfer import cuda_ipc, shm

log = logging.getLogger("epdserve.worker")

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="epdserve tensor-parallel rank",
                                     description="a follower rank of a tensor-parallel worker (started by rank 0)")
    for name, kind in (("--rank", int), ("--size", int), ("--store-port", int), ("--control", str),
                       ("--replies", str), ("--model", str), ("--dtype", str), ("--weight-format", str),
                       ("--device", str), ("--cores", str), ("--parent-pid", int), ("--worker", str)):
        parser.add_argument(name, type=kind, required=True)
    parser.add_argument("--part", choices=PARTS, default="language")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    return parser


def follow(argv: list[str] | None = None) -> int:
    """Returns 0 after ``stop``, 1 when rank 0 is gone or a call failed, 2 when its shard cannot be loaded."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to act on
    cores = [int(c) for c in args.cores.split(",")]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    device = args.device
    ctx = zmq.Context()
    control, replies = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    control.connect(args.control)
    replies.connect(args.replies)
    try:
        try:
            model = _load_part(args, device)
        except Exception as exc:
            replies.send(M.encode_reply(args.rank, "error", str(exc)))
            return 2
        replies.send(M.encode_reply(args.rank, "loaded"))
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        store = dist.TCPStore("127.0.0.1", args.store_port, args.size, False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            return _serve_calls(model, control, replies, args, device)
        finally:
            dist.destroy_process_group()
    finally:
        ctx.destroy(linger=1000)


def _load_part(args, device: str) -> LlamaModel | VisionEncoder:
    tp = TPRank(args.rank, args.size)
    if args.part == "vision":
        return VisionEncoder.load(args.model, DTYPES[args.dtype], device, tp)
    return load_language_model(args.model, DTYPES[args.dtype], args.weight_format, device, tp)[0]


def _serve_calls(model: LlamaModel | VisionEncoder, control: zmq.Socket, replies: zmq.Socket, args, device: str) -> int:
    """Returns 0 after ``stop``, 1 when rank 0 is gone or a call failed."""
    name = f"{args.worker} rank {args.rank}/{args.size}"
    kv_cache, shared = None, []
    while True:
        if not control.poll(POLL_S * 1000):
            if os.getppid() != args.parent_pid:
                log.error("%s: rank 0 is gone; leaving", name)
                return 1
            continue
        header, tensors = M.decode(control.recv_multipart())
        op = header["op"]
        if op == "stop":
            return 0
        try:
            if op == "init":
                kv_cache = _kv_cache(model, header, args.rank, shared)
                replies.send(M.encode_reply(args.rank, "ready", handle=shared[0].handle_bytes if shared else b""))
                log.info("%s: cores %s, device %s, %d KV blocks", name, args.cores, device, header["num_blocks"])
            else:
                _call(model, kv_cache, header, tensors, device)
        except Exception:
            log.exception("%s: %s failed; leaving (rank 0's step fails with it)", name, op)
            return 1


def _kv_cache(model: LlamaModel, init: dict, rank: int, shared: list) -> torch.Tensor:
    """Its part of rank 0's pool, or (no pool: on CUDA) its own in a ``cuda_ipc.DevicePool``
    appended to ``shared``, whose handle rank 0 opens."""
    if init["pool"] is not None:
        return shm.map_part(init["pool"], tuple(init["shape"]), DTYPES[init["dtype"]], init["split"], rank)

    def share(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shared.append(cuda_ipc.DevicePool(shape, dtype, device))
        return shared[-1].kv

    return model.allocate_kv_cache(init["num_blocks"], init["block_size"], share, DTYPES[init["dtype"]])


def _call(model: LlamaModel | VisionEncoder, kv_cache: torch.Tensor | None, header: dict,
          tensors: list[torch.Tensor], device: str) -> None:
    """Its outputs are discarded: rank 0 computes the same. Raises MessageError: an unknown op, or a
    language model's call before ``init``."""
    if header["op"] == "encode":
        model.encode(tensors[0])
        return
    if kv_cache is None:
        raise M.MessageError(f"{header['op']} before init")
    if header["op"] in M.STEP_OPS:
        input_ids, meta, embeds = runner.on_device(*M.decode_step(header, tensors), torch.device(device))
        getattr(model, header["op"])(input_ids, meta, kv_cache, embeds)
    elif header["op"] == "logits":
        model.logits(tensors[0].to(device))
    else:
        raise M.MessageError(f"unknown op {header['op']!r}")


if __name__ == "__main__":
    sys.exit(follow())
