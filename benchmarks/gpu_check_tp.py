"""The ``tensor_parallel`` section of ``benchmarks/gpu_check.py``: our engine's TP=2
forward passes against TP=1 on the parity checks' seeded small Llama
(:func:`gpu_check_serve.parity_llama`: 2 KV heads, so one a rank), float32.

The same 4 prompts (:func:`gpu_check_serve.parity_prompts`) run as one batched prefill and
then decode steps, greedy, through ``engine/runner.run`` over a paged KV cache: once whole in
this process (TP=1) and once as 2 ranks, each a spawned process holding its shard
(``LlamaModel.load(..., tp=...)``) and its KV heads' cache. The goal: every rank's greedy
tokens equal TP=1's; the max |logit difference| is reported (the all-reduces add float32
partial sums in another order: ~1e-5, not whole units).

Backend and devices: with ``--device cuda`` and 2 or more GPUs, NCCL with rank r on
``cuda:r`` (TP=1 on ``cuda:0``); with one GPU, both ranks on it over gloo (NCCL needs a GPU
a rank; gloo all-reduces CUDA tensors through host memory): the CUDA code path's parity,
not NCCL's speed; with ``--device cpu`` (``--smoke``), gloo on the CPU over 127.0.0.1, one
thread a rank. The JSON names the backend and the devices.

The all-reduce cost, two ways: the time inside the collectives of each step (every
all-reduce and the logits gather, waits for the other rank included; on CUDA the device is
synchronized around each, so that the time is the collective's, not its launch), and
:data:`CALLS` all-reduces of ``[T, hidden]`` alone in a loop (ms per call, and per step:
``2 x layers + 1`` of them), for this model's steps and for the 8B shape's hidden size
(bf16 on CUDA) at the throughput section's batch sizes and prefill length.

The KV hand-off across TP sizes (``handoff`` in the JSON): a TP=2 engine (this process its
rank 0, a follower process started by the product's ``Ranks``, on the same backend and
devices) prefills each prompt and hands its KV over to a TP=1 engine through the real
exporter and importer (a staged frame in /dev/shm: on CUDA each rank's KV part lies on its
GPU, which rank 0 opens by CUDA IPC), and the other way; the greedy tokens and frame bytes of
each, against TP=1 → TP=1's.

A rank that fails, dies or overruns :data:`RANKS_TIMEOUT_S` fails the section; the rank
processes are killed whatever happens.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import gpu_check_serve as S  # (the benchmarks folder is on sys.path: gpu_check.py's, or the spawner's)

from epdserve.engine import runner
from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams, Sequence
from epdserve.engine.scheduler import ScheduledBatch
from epdserve.model.llama import LlamaModel
from epdserve.model.tensor_parallel import TPRank

SIZE = 2
BLOCK = 16
CALLS = 100  # all-reduces timed in a loop, per shape
RANKS_TIMEOUT_S = 150.0  # the ranks' whole run: spawn, imports, CUDA / NCCL start, load, steps, loops
GROUP_TIMEOUT = timedelta(seconds=60)  # a rank waiting to join the group or inside a collective
COLLECTIVE_S = [0.0]  # (in a rank's process) seconds inside the collectives in this step


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class TimedRank(TPRank):
    """A :class:`TPRank` adding the time of each collective to :data:`COLLECTIVE_S` (on
    CUDA the device is drained before and after it: the collective's own time)."""

    def all_reduce(self, x):
        sync(x.device)
        start = time.perf_counter()
        super().all_reduce(x)
        sync(x.device)
        COLLECTIVE_S[0] += time.perf_counter() - start
        return x

    def gather_last_dim(self, x, sizes):
        sync(x.device)
        start = time.perf_counter()
        out = super().gather_last_dim(x, sizes)
        sync(x.device)
        COLLECTIVE_S[0] += time.perf_counter() - start
        return out


def run_steps(model: LlamaModel, prompts: list[list[int]], tokens: int) -> dict:
    """One batched prefill of ``prompts``, then ``tokens - 1`` decode steps of all of them,
    greedy, through ``engine/runner.run`` over a paged KV cache. Returns each prompt's
    ``tokens`` tokens, each step's logits (float32 numpy), ms and ms inside collectives."""
    per_seq = -(-(max(map(len, prompts)) + tokens) // BLOCK)
    kv_cache = model.allocate_kv_cache(len(prompts) * per_seq, BLOCK)
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=tokens, temperature=0)) for i, p in enumerate(prompts)]
    for i, seq in enumerate(seqs):
        seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
    plan = [[len(p) for p in prompts]] + [[1] * len(prompts)] * (tokens - 1)
    out = {"logits": [], "step_ms": [], "collective_ms": []}
    for num_tokens in plan:
        COLLECTIVE_S[0] = 0.0
        sync(model.device)
        start = time.perf_counter()
        logits, sampled = runner.run(model, ScheduledBatch(seqs=seqs, num_tokens=num_tokens), kv_cache)
        sync(model.device)
        out["step_ms"].append((time.perf_counter() - start) * 1e3)
        out["collective_ms"].append(COLLECTIVE_S[0] * 1e3)
        for seq, n in zip(seqs, num_tokens):
            seq.num_computed_tokens += n
        for row, index in enumerate(sampled):
            seqs[index].token_ids.append(int(logits[row].argmax()))
        out["logits"].append(logits.float().cpu().numpy().copy())
    out["tokens"] = [s.token_ids[s.num_prompt_tokens:] for s in seqs]
    return out


def all_reduce_ms(rows: int, hidden: int, dtype: str, device: str) -> float:
    """ms per all-reduce of a ``[rows, hidden]`` tensor, :data:`CALLS` of them in a loop."""
    x = torch.zeros(rows, hidden, dtype=getattr(torch, dtype), device=device)
    for _ in range(5):
        dist.all_reduce(x)
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(CALLS):
        dist.all_reduce(x)
    sync(device)
    return (time.perf_counter() - start) / CALLS * 1e3


def rank_main(rank: int, backend: str, devices: list[str], port: int, model_dir: str, prompts: list[list[int]],
              tokens: int, loops: list[dict], results) -> None:
    """One rank's process: join the group, load its shard, :func:`run_steps`, then the
    all-reduce loops; puts ``(rank, result)`` on ``results``, or ``(rank, traceback text)``."""
    try:
        if backend == "gloo":
            torch.set_num_threads(1)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if devices[rank].startswith("cuda"):
            torch.cuda.set_device(devices[rank])
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(devices),
                                timeout=GROUP_TIMEOUT)
        try:
            model = LlamaModel.load(model_dir, torch.float32, "f32", device=devices[rank],
                                    tp=TimedRank(rank, len(devices)))
            out = run_steps(model, prompts, tokens)
            out["all_reduce_ms"] = [all_reduce_ms(r["rows"], r["hidden"], r["dtype"], devices[rank]) for r in loops]
            results.put((rank, out))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()[-3000:]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(backend: str, devices: list[str], *args) -> list[dict]:
    """:func:`rank_main` (``*args`` after the port) in a spawned process a device; each
    rank's result. Raises RuntimeError on a rank's error, death or :data:`RANKS_TIMEOUT_S`;
    the processes are ended in every case."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, backend, devices, port, *args, results), daemon=True)
             for r in range(len(devices))]
    got: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        while len(got) < len(procs):
            try:
                rank, result = results.get(timeout=1.0)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if dead:
                    raise RuntimeError(f"TP rank(s) died (rank: exit code) {dead}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result from TP ranks {sorted(set(range(len(procs))) - set(got))} "
                                       f"within {RANKS_TIMEOUT_S:.0f} s") from None
                continue
            if isinstance(result, str):
                raise RuntimeError(f"TP rank {rank} failed:\n{result}")
            got[rank] = result
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()
    return [got[r] for r in range(len(procs))]


def loop_shapes(config: dict, shape: dict, prompts: list[list[int]], cuda: bool) -> list[dict]:
    """The all-reduces timed in a loop: this model's decode and prefill steps ([4, 128] and
    [119, 128] float32; 3 layers: 7 a step), then the 8B shape's (``config``) hidden at the
    throughput section's decode batches and prefill length (bf16 on CUDA)."""
    rows = [dict(model="parity-llama", rows=len(prompts), hidden=128, dtype="float32", per_step=7),
            dict(model="parity-llama", rows=sum(map(len, prompts)), hidden=128, dtype="float32", per_step=7)]
    big = dict(model="throughput shape", hidden=config["hidden_size"], dtype="bfloat16" if cuda else "float32",
               per_step=2 * config["num_hidden_layers"] + 1)
    return rows + [dict(big, rows=n) for n in (*shape["decode_batches"], shape["prefill_len"])]


def summary(whole: dict, ranks: list[dict], loops: list[dict]) -> dict:
    """Tokens and logits of every rank against TP=1's, and the time per step and in the
    collectives (decode: the mean over the decode steps; per step, the slowest rank's)."""
    equal = sum(a == b for x, y in zip(ranks[0]["tokens"], whole["tokens"]) for a, b in zip(x, y))
    diffs = [float(np.abs(a - b).max()) for r in ranks for a, b in zip(r["logits"], whole["logits"])]
    agree = all(np.array_equal(a, b) for r in ranks[1:] for a, b in zip(r["logits"], ranks[0]["logits"]))
    steps = len(whole["step_ms"])
    collective = [max(r["collective_ms"][i] for r in ranks) for i in range(steps)]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    for row, ms in zip(loops, ranks[0]["all_reduce_ms"]):
        row.update(ms=ms, per_step_ms=ms * row["per_step"])
    return {"tokens_equal": all(r["tokens"] == whole["tokens"] for r in ranks), "tokens_equal_count": equal,
            "tokens": sum(map(len, whole["tokens"])), "ranks_agree": agree, "max_abs_logit_diff": max(diffs),
            "max_abs_logit": float(max(np.abs(x).max() for x in whole["logits"])),
            "tp1_ms": {"prefill": whole["step_ms"][0], "decode": mean(whole["step_ms"][1:])},
            "tp2_ms": {"prefill": ranks[0]["step_ms"][0], "decode": mean(ranks[0]["step_ms"][1:])},
            "tp2_collective_ms": {"prefill": collective[0], "decode": mean(collective[1:])},
            "collectives_per_step": "7 all-reduces of [T, 128] (embedding, 2 a layer) + 1 gather of [S, 512] logits",
            "all_reduce": loops}


def hand_offs(devices: list[str], model_dir: Path, prompts: list[list[int]], tokens: int) -> dict:
    """The prompts handed over TP=1 → TP=1, TP=2 → TP=1 and TP=1 → TP=2 (see the module doc):
    ``tokens_equal`` (both = TP=1 → TP=1's), ``kv_bytes_equal`` and each way's tokens,
    ``kv_bytes`` and mean ``kv_export_ms`` / ``kv_import_ms``."""
    import zmq

    from epdserve.serving.worker.ranks import Ranks
    from epdserve.transfer.handoff import Exporter, Importer
    from epdserve.transfer.loopback import generate_pd

    config = EngineConfig(kv_cache_memory_mb=64, weight_format="f32", dtype="float32", device=devices[0],
                          enforce_eager=True, enable_prefix_caching=False)
    sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    cores = sorted(os.sched_getaffinity(0))
    ranks = Ranks.start(SIZE, "gpu-check-tp2", str(model_dir), "float32", "f32", devices[0],
                        [[cores[r % len(cores)]] for r in range(SIZE)], devices=devices)
    ctx = zmq.Context()
    try:
        one, other, two = (LLMEngine(str(model_dir), config), LLMEngine(str(model_dir), config),
                           LLMEngine(str(model_dir), config, tp=ranks))
        ways = {}
        for name, prefill, decode in (("tp1_to_tp1", one, other), ("tp2_to_tp1", two, one), ("tp1_to_tp2", one, two)):
            exporter, importer = Exporter(prefill, 60, ctx, None), Importer(ctx, "shm", 30)
            try:
                runs = [generate_pd(prefill, decode, exporter, importer, f"{name}-{i}", p, sampling)
                        for i, p in enumerate(prompts)]
            finally:
                exporter.close()
                importer.close()
            ways[name] = {"tokens": [t for t, _ in runs], "kv_bytes": [int(s.kv_bytes) for _, s in runs],
                          "kv_export_ms": float(np.mean([s.kv_export_ms for _, s in runs])),
                          "kv_import_ms": float(np.mean([s.kv_import_ms for _, s in runs]))}
    finally:
        ranks.close()
        ctx.destroy(linger=0)
    base = ways["tp1_to_tp1"]
    return {"tokens_equal": all(w["tokens"] == base["tokens"] for w in ways.values()),
            "kv_bytes_equal": all(w["kv_bytes"] == base["kv_bytes"] for w in ways.values()), **ways}


def tensor_parallel(device: str, shape: dict, config: dict, workdir: Path) -> dict:
    """The section (see the module doc); ``config`` is the throughput section's shape."""
    cuda = device.startswith("cuda")
    if not cuda:
        backend, devices = "gloo", ["cpu"] * SIZE
    elif torch.cuda.device_count() < SIZE:
        backend, devices = "gloo", ["cuda:0"] * SIZE
    else:
        backend, devices = "nccl", [f"cuda:{r}" for r in range(SIZE)]
    model_dir = workdir / "tp-llama"
    S.parity_llama(model_dir)
    prompts, tokens = S.parity_prompts(), shape["parity_tokens"]
    loops = loop_shapes(config, shape, prompts, cuda)
    whole = run_steps(LlamaModel.load(str(model_dir), torch.float32, "f32", device=devices[0]), prompts, tokens)
    ranks = run_ranks(backend, devices, str(model_dir), prompts, tokens, loops)
    out = {"backend": backend, "devices": devices, "tp1_device": devices[0], "size": SIZE, "dtype": "float32",
           "prompt_lens": [len(p) for p in prompts], "tokens_per_prompt": tokens, "decode_steps": tokens - 1,
           **summary(whole, ranks, loops), "handoff": hand_offs(devices, model_dir, prompts, tokens)}
    if backend == "gloo":
        out["note"] = (f"gloo on {devices[0]} (127.0.0.1; every rank on it): the parity check; not NCCL's "
                       "collectives, whose times these are not")
    tqdm.write(f"  TP={SIZE} ({backend} on {', '.join(devices)}) greedy tokens equal TP=1's: {out['tokens_equal']} "
               f"({out['tokens_equal_count']}/{out['tokens']}); max |logit diff| {out['max_abs_logit_diff']:.2e}")
    h = out["handoff"]
    tqdm.write(f"  KV hand-off TP=2 -> TP=1 and TP=1 -> TP=2: tokens = TP=1 -> TP=1's: {h['tokens_equal']}, "
               f"frame bytes equal: {h['kv_bytes_equal']}")
    tqdm.write(f"  TP={SIZE} decode step {out['tp2_ms']['decode']:.2f} ms (collectives "
               f"{out['tp2_collective_ms']['decode']:.2f} ms) vs TP=1 {out['tp1_ms']['decode']:.2f} ms")
    for row in loops:
        tqdm.write(f"  all-reduce [{row['rows']}, {row['hidden']}] {row['dtype']}: {row['ms']:.3f} ms "
                   f"(x{row['per_step']} a step: {row['per_step_ms']:.2f} ms)")
    return out
