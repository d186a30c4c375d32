"""``epdserve serve --cluster ray -tp N`` on a real one-node Ray cluster of 2 CPUs (``ray
start --head`` in a session of its own, stopped by the module on every outcome):

* ``-tp 2``: the worker is one placement group of 2 bundles (one a rank) with strategy
  STRICT_PACK, holding both CPUs; its ranks are pinned to the 2 cores its actor claimed and
  its greedy chat answer equals the float32 engine's in one process; a second ``serve -tp
  2`` finds the CPUs taken and stops within its ``--startup-timeout``, naming the worker;
  kill -9 of the actor (rank 0) takes its follower with it and Ray restarts the worker in
  the same group; after Ctrl-C the group is gone and the CPUs are free;
* ``-tp 3`` (3 CPUs on one node) stops ``serve`` at once with one line naming the worker
  and what it needed, and leaves no group behind;
* ``--mode pd --prefill-tp 2`` (a node of 3 CPUs and 3 GPUs as Ray counts them, none
  real): a group per worker, 2 bundles and 1 of ``CPU=1,GPU=1``, the prefill worker's
  ranks both seeing its bundles' 2 GPUs (``CUDA_VISIBLE_DEVICES``), and the answer of one
  process through a KV hand-off;
* a spread placement of TP workers is refused before anything starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from conftest import generate, interrupt
from test_faults_workers import wait_for
from test_ray import one_node, ray_deployment, worker
from test_tensor_parallel_serve import ask, follower_pids

from epdserve.engine.engine import EngineConfig, LLMEngine
from epdserve.engine.request import SamplingParams
from epdserve.model.tokenizer import chat_prompt_ids
from epdserve.serving.launch import ray_ranks
from epdserve.serving.launch.options import RayOptions, ServeOptions
from epdserve.serving.launch.ray_cluster import role_resources
from epdserve.serving.router.options import ElasticOptions, RouterOptions

pytestmark = pytest.mark.cluster

MAX_TOKENS = 6
CHAT = [{"role": "user", "content": "Hi!"}]
RESTART_TIMEOUT_S = 120
# The cluster's placement groups and free CPUs, from a driver of its own (serve's is another job).
GROUPS = """
import json, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(json.dumps({"groups": [{"id": g["placement_group_id"], "strategy": g["strategy"], "state": g["state"],
                              "bundles": list(g["bundles"].values())}
                             for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"],
                  "free_cpus": ray.available_resources().get("CPU", 0.0)}))
"""


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray cluster of 2 logical CPUs (this machine's 2 cores); its address."""
    yield from one_node(2)


def cluster_groups(address: str) -> dict:
    """``{"groups": [the placement groups not removed], "free_cpus": ...}`` of the cluster."""
    proc = subprocess.run([sys.executable, "-c", GROUPS, address], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_fails(address: str, *extra: str, timeout_s: float = 180) -> tuple[subprocess.CompletedProcess, float]:
    """``serve --cluster ray`` expected to stop by itself: its result and seconds taken."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "epdserve", "serve", "--mode", "colocated", "--cluster", "ray",
                           "--ray-address", address, "--port", "0", "--kv-cache-memory-mb", "128", *extra],
                          capture_output=True, text=True, timeout=timeout_s)
    return proc, time.monotonic() - t0


def reference_tokens(model_info, tokenizer) -> list[int]:
    """The greedy tokens of :data:`CHAT` from the float32 engine in this process."""
    engine = LLMEngine(str(model_info.path), EngineConfig(kv_cache_memory_mb=64, weight_format="f32"))
    (tokens,) = generate(engine, [chat_prompt_ids(tokenizer, CHAT)],
                         SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return tokens


def check_group(address: str) -> str:
    """The one placement group of a ``-tp 2`` worker: 2 bundles of CPU=1, STRICT_PACK, both
    CPUs taken; its id."""
    state = cluster_groups(address)
    (group,) = state["groups"]
    assert (group["strategy"], group["state"]) == ("STRICT_PACK", "CREATED"), group
    assert group["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}] and state["free_cpus"] == 0.0, state
    return group["id"]


def check_ranks(dep) -> int:
    """The worker's ranks each pinned to one of its 2 claimed cores; its follower's pid."""
    w = worker(dep, "colocated-0")
    assert (w["tensor_parallel_size"], w["resources"], w["state"]) == (2, {"CPU": 2.0}, "up"), w
    assert sorted(w["cores"]) == w["cores"] and len(w["cores"]) == 2, w
    (follower,) = follower_pids(w["pid"])
    assert os.sched_getaffinity(w["pid"]) == {w["cores"][0]} and os.sched_getaffinity(follower) == {w["cores"][1]}
    return follower


def check_busy_cluster_times_out(address: str) -> None:
    """A second ``-tp 2`` worker while the first holds both CPUs: refused within its
    ``--startup-timeout`` (5 s), naming it and what it needed."""
    proc, took = serve_fails(address, "-tp", "2", "--startup-timeout", "5")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("Ray could not place worker colocated-0 within 5 s: it needs 2 bundles of CPU=1 (one a tensor-parallel "
            "rank) on one node (STRICT_PACK), CPU=2 in all; the cluster has" in proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and took < 120, took


def kill_rank0_and_wait(dep, follower: int, group_id: str, address: str) -> None:
    """kill -9 of the actor: its follower goes with it, Ray restarts the worker in its group."""
    old = worker(dep, "colocated-0")["pid"]
    t_kill = time.monotonic()
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{follower}"), 30, "the follower to die with rank 0")
    wait_for(lambda: worker(dep, "colocated-0")["pid"] != old and worker(dep, "colocated-0")["state"] == "up",
             RESTART_TIMEOUT_S, "Ray to restart colocated-0")
    print(f"\nkill -9 of rank 0 (Ray actor): back after {time.monotonic() - t_kill:.1f} s")
    assert check_group(address) == group_id  # the same group, restarted in its bundle 0
    check_ranks(dep)


def visible_gpus(pid: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of process ``pid`` (its environment), as a list."""
    env = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    return env["CUDA_VISIBLE_DEVICES"].split(",")


def test_pd_with_a_tp2_prefill_worker_is_a_group_per_worker_and_hands_kv_over(tmp_path, model_info, tokenizer):
    """``--mode pd --prefill-tp 2`` on a node of 3 CPUs and 3 GPUs as Ray counts them (first
    in the module: before the module's 2-CPU cluster starts; the workers run on the CPU): a
    group of 2 bundles for the prefill worker, one of 1 for the decode worker, both
    STRICT_PACK; both prefill ranks see the GPUs of its 2 bundles, two distinct ones; the
    answer of one float32 process, through a KV hand-off."""
    want = reference_tokens(model_info, tokenizer)
    with contextlib.contextmanager(one_node)(3, "--num-gpus", "3") as address:
        dep = ray_deployment("pd", tmp_path, address, "--prefill-tp", "2", "--weight-format", "f32",
                             "--prefill-resources", "CPU=1,GPU=1", "--decode-resources", "CPU=1,GPU=1")
        try:
            log = dep.log_tail(10**6)
            assert ("prefill-0 on Ray (2 ranks of CPU=1,GPU=1, STRICT_PACK), decode-0 on Ray (1 rank of "
                    "CPU=1,GPU=1, STRICT_PACK)" in log), log[-2000:]
            groups = cluster_groups(address)["groups"]
            assert sorted(len(g["bundles"]) for g in groups) == [1, 2]
            assert all(g["strategy"] == "STRICT_PACK" for g in groups)
            prefill, decode = worker(dep, "prefill-0"), worker(dep, "decode-0")
            assert (prefill["tensor_parallel_size"], decode["tensor_parallel_size"]) == (2, 1)
            assert (prefill["resources"], decode["resources"]) == ({"CPU": 2.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0})
            # Rank 0 sets them in its own process (not in /proc/PID/environ); its follower
            # starts with them.
            (gpus,) = re.findall(r"started worker prefill-0 as a Ray actor \(2 ranks of CPU=1,GPU=1; GPUs (\S+)\)", log)
            (follower,) = follower_pids(prefill["pid"])
            assert visible_gpus(follower) == gpus.split(",") and len(set(gpus.split(","))) == 2, (gpus, log[-2000:])
            assert ask(dep.url, "chat", CHAT, MAX_TOKENS) == want
            one = dep.generate("completion", "The history of the printing press", stream=False, max_tokens=4,
                               temperature=0)
            assert dep.trace(one.id)["kv_bytes"] > 0
        finally:
            interrupt(dep.proc)
        assert cluster_groups(address)["groups"] == []


def test_tp2_worker_is_one_strict_pack_group_and_answers_as_one_process(ray_head, tmp_path, model_info, tokenizer):
    want = reference_tokens(model_info, tokenizer)
    t0 = time.monotonic()
    dep = ray_deployment("colocated", tmp_path, ray_head, "-tp", "2")
    try:
        print(f"\nserve -tp 2 on Ray: ready in {time.monotonic() - t0:.1f} s")
        assert "colocated-0 on Ray (2 ranks of CPU=1, STRICT_PACK)" in dep.log_tail(10**6)
        group_id = check_group(ray_head)
        follower = check_ranks(dep)
        assert ask(dep.url, "chat", CHAT, MAX_TOKENS) == want
        check_busy_cluster_times_out(ray_head)
        kill_rank0_and_wait(dep, follower, group_id, ray_head)
        assert ask(dep.url, "chat", CHAT, MAX_TOKENS) == want
    finally:
        interrupt(dep.proc)
    assert dep.proc.returncode == 0 and "all workers stopped" in dep.log_tail(10**6)
    wait_for(lambda: cluster_groups(ray_head) == {"groups": [], "free_cpus": 2.0}, 30, "the group removed")


def test_unplaceable_tp_stops_serve_at_once_naming_the_worker(ray_head):
    proc, took = serve_fails(ray_head, "-tp", "3", "--startup-timeout", "120")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("epdserve serve: error: Ray cannot place worker colocated-0: it needs 3 bundles of CPU=1 (one a "
            "tensor-parallel rank) on one node (STRICT_PACK), CPU=3 in all; no node has that (the live nodes have "
            "CPU=2;" in proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert took < 90, f"{took:.1f} s: not refused at once (the --startup-timeout is 120 s)"
    print(f"\nserve -tp 3 on 2 CPUs: refused after {took:.1f} s")
    wait_for(lambda: cluster_groups(ray_head) == {"groups": [], "free_cpus": 2.0}, 30, "no group left")


def test_tp_with_a_spread_placement_is_refused():
    args = ServeOptions(worker={"tensor_parallel_size": 2}, ray=RayOptions(worker_placement="SPREAD"))
    with pytest.raises(ValueError, match=r"^--worker-placement SPREAD with --tensor-parallel-size 2 on Ray: each worker "
                                         r"is a placement group of its own \(2 bundles, STRICT_PACK: its ranks on one"):
        ray_ranks.check_options(args)
    args = ServeOptions(RouterOptions(mode="epd"), encode_tp=2, ray=RayOptions(worker_placement="SPREAD"))
    with pytest.raises(ValueError, match=r"^--worker-placement SPREAD with --encode-tp 2 on Ray: each worker is a "):
        ray_ranks.check_options(args)
    for mode, elastic in (("colocated", False), ("pd", False), ("colocated", True)):
        ray_ranks.check_options(ServeOptions(RouterOptions(mode=mode, elastic=ElasticOptions(elastic)),
                                             worker={"tensor_parallel_size": 2}))


@pytest.mark.parametrize("gpus", ["0.5", "2"])
def test_a_rank_takes_one_whole_gpu_or_none(gpus):
    args = ServeOptions(RouterOptions(mode="pd"), prefill_tp=2, ray=RayOptions(
        prefill_resources=f"CPU=1,GPU={gpus}", decode_resources=f"GPU={gpus}"))
    with pytest.raises(ValueError, match=rf"^--prefill-resources GPU={gpus} with 2 tensor-parallel ranks on Ray: each "
                                         r"rank runs on one whole GPU of its own bundle \(give GPU=1, or no GPU"):
        role_resources(args)
    args = replace(args, prefill_tp=1)  # one rank a worker: any share of a GPU, as before
    assert role_resources(args)["decode"] == {"GPU": float(gpus), "CPU": 1.0}
