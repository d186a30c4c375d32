"""The ranks of a tensor-parallel worker (``--tensor-parallel-size N``), seen from rank 0, the worker
process: it starts the followers (:mod:`~epdserve.serving.worker.follower`), sends them each call
of the model or vision tower (:mod:`~epdserve.serving.worker.rank_messages`), gives them their KV
cache and sees them fail. Messages, start-up, KV pool, failure and placement:
docs/tensor-parallel.md#a-tensor-parallel-worker."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from epdserve.model import kv_cache_dtype
from epdserve.model.llama import AttentionMetadata, LlamaModel
from epdserve.model.tensor_parallel import TPRank, even_range
from epdserve.model.vision import VisionEncoder
from epdserve.serving.worker import rank_messages as M
from epdserve.transfer import cuda_ipc, shm

log = logging.getLogger("epdserve.worker")

START_TIMEOUT_S = 600.0  # a follower's load, and each later start-up reply
# A rank's wait in one collective (and to join the group): a follower that hangs holds rank 0 this long.
COLLECTIVE_TIMEOUT_S = 60.0
POLL_S = 0.1  # a follower's wait for its next message before checking on rank 0
STOP_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1
PARTS = ("language", "vision")  # what a follower loads: the language model or the vision tower
_SOCKETS_DIR = re.compile(r"epdserve-tp-([0-9]{1,10})-\w+")  # the ranks' ipc directory, by rank 0's pid


class RankFailure(RuntimeError):
    """The ranks are out of step: the worker exits, to be restarted whole."""


def split_cores(cores: list[int], size: int) -> list[list[int]]:
    """Contiguous and as even as possible, the extra cores to the first ranks (0,1,2 over 2
    ranks: 0,1 and 2). Raises ValueError: fewer cores than ranks."""
    if len(cores) < size:
        raise ValueError(f"--tensor-parallel-size {size} needs {size} cores; this worker has {len(cores)}: "
                         "each rank needs one (give the worker more --cores or use fewer ranks)")
    return [[cores[i] for i in even_range(len(cores), size, r)] for r in range(size)]


def rank_device(device: str, rank: int) -> str:
    """The CPU, or the ``rank``-th GPU from ``device`` (``cuda:1``, 2 ranks: ``cuda:1`` and ``cuda:2``)."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{int(device.partition(':')[2] or 0) + rank}"


def tp_backend(devices: list[str]) -> str:
    """NCCL when each rank has a GPU of its own, else gloo (ranks sharing a GPU go through host
    memory: how a one-GPU host checks the CUDA path)."""
    cuda = all(d.startswith("cuda") for d in devices) and len(set(devices)) == len(devices)
    return "nccl" if cuda else "gloo"


class _Driven:
    """Rank 0's shard ``model``: each forward-pass call goes to every follower first; raises
    :class:`RankFailure` when one is gone or the call fails."""

    def __init__(self, model, ranks: Ranks):
        self.model, self.ranks = model, ranks

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def _run(self, frames: list, call, *args):
        self.ranks.send(frames)
        try:
            return call(*args)
        except Exception as exc:
            raise self.ranks.failure(exc) from exc


class DrivenModel(_Driven):
    """Rank 0's ``LlamaModel`` in a tensor-parallel engine worker (see :class:`_Driven`)."""

    def hidden_states(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                      embeds=None, kv_written=None) -> torch.Tensor:
        """``kv_written`` is rank 0's alone."""
        return self._run(M.encode_step("hidden_states", input_ids, meta, embeds), self.model.hidden_states,
                         input_ids, meta, kv_cache, embeds, kv_written)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                embeds=None, kv_written=None) -> torch.Tensor:
        """The full logits ``[S, vocab]``."""
        return self._run(M.encode_step("forward", input_ids, meta, embeds), self.model.forward,
                         input_ids, meta, kv_cache, embeds, kv_written)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> ``[R, vocab]``."""
        return self._run(M.encode("logits", [hidden]), self.model.logits, hidden)


class DrivenVision(_Driven):
    """Rank 0's ``VisionEncoder`` in a tensor-parallel encode worker (see :class:`_Driven`)."""

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles ``[N, 3, H, W]``."""
        return self._run(M.encode("encode", [pixel_values]), self.model.encode, pixel_values)


class Ranks:
    """Implements ``model.tensor_parallel.RankDriver``; build with :meth:`start`, end with
    :meth:`close` (idempotent; the followers also leave when this process ends)."""

    def __init__(self, size: int, worker_id: str, devices: list[str]):
        self.rank = TPRank(0, size)
        self.size, self.worker_id, self.devices, self.device = size, worker_id, devices, devices[0]
        self.backend = tp_backend(devices)
        # gloo's connections on the loopback only (the followers inherit it): the ranks share a host.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        remove_stale_dirs()
        self.dir = tempfile.mkdtemp(prefix=f"epdserve-tp-{os.getpid()}-")  # mode 0700: only we reach the sockets
        self.ctx = zmq.Context()
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.bind(f"ipc://{self.dir}/replies")
        self.controls: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self.store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                                   wait_for_workers=False)
        self.joined = self.closed = False
        self.pool: shm.KVPool | None = None
        self.opened = cuda_ipc.IpcImporter() if self.device.startswith("cuda") else None  # followers' GPU parts

    @classmethod
    def start(cls, size: int, worker_id: str, model_dir: str, dtype: str, weight_format: str, device: str,
              cores: list[list[int]], part: str = "language", devices: list[str] | None = None) -> Ranks:
        """Follower r, pinned to ``cores[r]``, loads ``part`` (:data:`PARTS`) of ``model_dir`` on
        ``devices[r]`` (default: :func:`rank_device`). Returns at once: :meth:`drive` or
        :meth:`drive_vision` waits for them."""
        ranks = cls(size, worker_id, devices or [rank_device(device, r) for r in range(size)])
        try:
            for r in range(1, size):
                ranks._spawn(r, model_dir, dtype, weight_format, cores[r], part)
        except BaseException:
            ranks.close()
            raise
        return ranks

    def _spawn(self, rank: int, model_dir: str, dtype: str, weight_format: str, cores: list[int], part: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self.dir}/control-{rank}"
        sock.bind(address)
        self.controls.append(sock)
        argv = [sys.executable, "-m", "epdserve.serving.worker.follower", "--rank", str(rank), "--size", str(self.size),
                "--store-port", str(self.store.port), "--control", address, "--replies", f"ipc://{self.dir}/replies",
                "--model", model_dir, "--dtype", dtype, "--weight-format", weight_format,
                "--device", self.devices[rank], "--backend", self.backend,
                "--cores", ",".join(map(str, cores)), "--parent-pid", str(os.getpid()), "--worker", self.worker_id,
                "--part", part]
        parent = os.getpid()
        self.procs.append(subprocess.Popen(argv, preexec_fn=lambda: _die_with_parent(parent)))
        log.info("%s: started tensor-parallel rank %d (pid %d) on cores %s", self.worker_id, rank,
                 self.procs[-1].pid, cores)

    def drive(self, model: LlamaModel, num_blocks: int, block_size: int,
              kv_dtype: torch.dtype) -> tuple[DrivenModel, list[torch.Tensor]]:
        """``model`` driven, and every rank's KV cache of ``num_blocks`` blocks, rank 0's first: on the
        CPU the parts of one /dev/shm :attr:`pool`; on CUDA each follower's, opened by CUDA IPC. Raises
        ValueError: a follower could not load its shard; RankFailure: a follower died or was silent for
        :data:`START_TIMEOUT_S`, or the process group did not form within :data:`COLLECTIVE_TIMEOUT_S`."""
        self._join()
        c = model.config
        shape = (c.num_hidden_layers, 2, num_blocks, block_size, sum(model.kv_head_split), c.head_dim)
        if self.opened is None:
            self.pool = shm.KVPool(shape, kv_dtype, model.kv_head_split)
            parts = self.pool.parts
        else:
            parts = [model.allocate_kv_cache(num_blocks, block_size, dtype=kv_dtype)]
        self.send(M.encode("init", num_blocks=num_blocks, block_size=block_size, shape=list(shape),
                           dtype=kv_cache_dtype.name_of(kv_dtype),
                           split=model.kv_head_split, pool=self.pool.name if self.pool else None))
        replies = self._await("ready")
        if self.opened is not None:
            parts += [self._open_part(replies[r]["handle"], shape, model.kv_head_split[r]) for r in range(1, self.size)]
        log.info("%s: %d tensor-parallel ranks ready (%s), %d KV blocks each", self.worker_id, self.size,
                 self.backend, num_blocks)
        return DrivenModel(model, self), parts

    def _open_part(self, handle: bytes, shape: tuple[int, ...], heads: int) -> torch.Tensor:
        """A follower's KV cache (``heads`` of the worker's ``shape``) by its CUDA IPC handle."""
        layout = {"num_layers": shape[0], "block_size": shape[3], "num_kv_heads": heads, "head_dim": shape[5]}
        return self.opened.open(cuda_ipc.unpack_handle(handle), layout)[0]

    def drive_vision(self, vision: VisionEncoder) -> DrivenVision:
        """Raises as :meth:`drive`."""
        self._join()
        log.info("%s: %d tensor-parallel ranks of the vision tower ready (%s)", self.worker_id, self.size,
                 self.backend)
        return DrivenVision(vision, self)

    def _join(self) -> None:
        """Wait for every follower's ``loaded``, then join the process group."""
        self._await("loaded")
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        try:
            dist.init_process_group(self.backend, store=self.store, rank=0, world_size=self.size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except Exception as exc:  # a follower died or hung before joining (DistStoreError, gloo's)
            raise self.failure(exc, "joining the process group") from exc
        self.joined = True

    def _await(self, state: str) -> dict[int, dict]:
        """Every follower's reply ``state``, by rank."""
        waiting, got = set(range(1, self.size)), {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            if not self.replies.poll(POLL_S * 1000):  # (a follower's error comes before its exit)
                self.check()
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor-parallel ranks {sorted(waiting)} of {self.worker_id} not {state} "
                                      f"within {START_TIMEOUT_S:.0f} s")
                continue
            reply = M.decode_reply(self.replies.recv())
            if reply["state"] == "error":
                raise ValueError(f"tensor-parallel rank {reply['rank']}: {reply['error']}")
            if reply["state"] == state:
                waiting.discard(reply["rank"])
                got[reply["rank"]] = reply
        return got

    def send(self, frames: list) -> None:
        """Without blocking. Raises RankFailure: a follower has exited or takes no more messages."""
        self.check()
        for rank, sock in enumerate(self.controls, start=1):
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                raise RankFailure(f"tensor-parallel rank {rank} of {self.worker_id} takes no messages") from None

    def check(self) -> None:
        """Raises :class:`RankFailure` if a follower has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RankFailure(f"tensor-parallel rank {rank} of {self.worker_id} (pid {proc.pid}) exited with "
                                  f"code {proc.returncode}")

    def failure(self, exc: Exception, what: str = "a forward pass", wait_s: float = 1.0) -> RankFailure:
        """The failure of ``what`` that raised ``exc``: the follower's exit if seen within ``wait_s``
        (its closed connection may come first), else ``exc``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check()
            except RankFailure as failure:
                return failure
            if time.monotonic() > deadline:
                return RankFailure(f"{what} across the tensor-parallel ranks of {self.worker_id} failed: "
                                   f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            time.sleep(0.02)

    def close(self) -> None:
        """``stop`` to each follower, SIGKILL after :data:`STOP_GRACE_S`."""
        if self.closed:
            return
        self.closed = True
        for sock in self.controls:
            try:
                sock.send_multipart(M.encode("stop"), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.opened is not None:
            self.opened.close()
        if self.joined:
            dist.destroy_process_group()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.pool is not None:
            self.pool.close()


def remove_stale_dirs() -> list[str]:
    """Socket directories of this user's ranks whose rank 0 is gone (a SIGKILL skips
    :meth:`Ranks.close`), deleted; returns their names."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob("epdserve-tp-*"):
        match = _SOCKETS_DIR.fullmatch(path.name)
        try:
            mine = path.stat().st_uid == os.getuid()
        except OSError:  # removed meanwhile
            continue
        if match and mine and not shm.pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _die_with_parent(parent_pid: int) -> None:
    """In a follower, before exec: SIGKILL when rank 0's process dies, even by kill -9."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the follower's parent pid check remains
    if os.getppid() != parent_pid:
        os._exit(1)
