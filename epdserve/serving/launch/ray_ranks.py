"""A tensor-parallel worker on Ray (``serve --cluster ray -tp N``, N > 1): its placement
group and its cores.

Each such worker is a placement group of its own: N bundles, one a rank, each of the
role's ``--worker-resources`` (what one rank needs: ``CPU=1`` by default, ``GPU=1``...),
strategy ``STRICT_PACK``, so that every rank of the worker is on one node (the ranks talk
over 127.0.0.1 and a private ipc directory, :mod:`epdserve.serving.worker.ranks`). The
actor, rank 0, runs in bundle 0; ranks 1..N-1 are processes it starts on the same node,
outside Ray, and bundles 1..N-1 hold their resources so that Ray places nothing else on
them. Ray restarts a dead actor in bundle 0 of the same group, and the new rank 0 starts
new followers. A group no node of the cluster can hold now is refused at once; one that
could be held but is not placed within ``--startup-timeout`` (other work holds the
resources) is refused then: :class:`PlacementError`, one line naming the worker and what
it needed.

GPUs: a rank of a GPU worker holds ``GPU=1`` of its bundle. Ray shows an actor only its own
bundle's GPU (``CUDA_VISIBLE_DEVICES``), and the followers are not actors; so before the
actor starts, a probe task in each bundle reads the GPU Ray reserved for it
(:func:`bundle_gpus`: a bundle's GPU is fixed when the group is placed), and the actor sets
``CUDA_VISIBLE_DEVICES`` to all of them in rank order, which its followers inherit: rank r
then runs on ``cuda:r``.

Cores: Ray counts CPUs but does not say which cores an actor may use, and a rank pins
itself to its share of its worker's cores (``--cores``, split by ``ranks.split_cores``).
So the actor claims ``N x CPU`` cores of its node (:func:`claim_cores`: an exclusive
``flock`` on one file per core in a directory of the user's under the temporary
directory, held until the actor's process ends, by kill -9 too) and gives them to the
worker as ``--cores``; each rank then runs ``CPU`` torch threads pinned to its share. Cores
claimed by another worker are shared only when too few are free.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path

from epdserve.argtypes import Options
from epdserve.serving.deployment import serve_tp_sizes

log = logging.getLogger("epdserve.ray")

STRATEGY = "STRICT_PACK"  # a worker's ranks: one node
CLAIMS_DIR = Path(tempfile.gettempdir()) / f"epdserve-cores-{os.getuid()}"


class PlacementError(TimeoutError):
    """Ray cannot place a tensor-parallel worker's group (never, on the cluster's nodes
    now, or not within ``--startup-timeout``). A ``TimeoutError``, as serve reports a
    role's placement that timed out: one line, exit status 1."""


def ranked(args: Options) -> bool:
    """Whether any worker of serve's options has more than one rank (``serve_tp_sizes``)."""
    return max(serve_tp_sizes(args).values()) > 1


def check_options(args: Options) -> None:
    """serve's options against tensor-parallel workers on Ray, before any worker starts.

    Raises:
        ValueError: a worker of more than one rank with a ``--worker-placement`` other than
            PACK (each worker is a STRICT_PACK group of its own; Ray places the groups).
    """
    if not ranked(args):
        return
    role, tp = max(serve_tp_sizes(args).items(), key=lambda item: item[1])
    flag = f"--{role}-tp" if getattr(args, f"{role}_tp", None) else "--tensor-parallel-size"
    if args.worker_placement != "PACK":
        raise ValueError(f"--worker-placement {args.worker_placement} with {flag} {tp} on Ray: each "
                         f"worker is a placement group of its own ({tp} bundles, {STRATEGY}: its ranks on one node) "
                         "and Ray places the groups; leave --worker-placement at PACK")


def check_gpus(res: dict[str, float], tp: int, option: str) -> None:
    """A rank's ``GPU`` amount in ``option`` (a role's ``--*-resources``) for a worker of
    ``tp`` ranks: none or one whole GPU a rank (a rank runs on one device).

    Raises:
        ValueError: ``tp`` > 1 and ``GPU`` is neither 0 nor 1, naming the option.
    """
    gpus = res.get("GPU", 0.0)
    if tp > 1 and gpus not in (0.0, 1.0):
        raise ValueError(f"{option} GPU={gpus:g} with {tp} tensor-parallel ranks on Ray: each rank runs on one "
                         "whole GPU of its own bundle (give GPU=1, or no GPU for a CPU worker)")


def bundle_gpus(group, tp: int, res: dict[str, float]) -> list[str] | None:
    """The GPU ids Ray reserved for bundles 0..tp-1 of placement group ``group`` (one a
    bundle, as Ray numbers the node's GPUs), in bundle order: what a GPU worker's actor
    sets as ``CUDA_VISIBLE_DEVICES`` for all its ranks. A task of ``GPU=1`` and no CPU runs
    in each bundle and returns ``ray.get_gpu_ids()``. None without a ``GPU`` in a rank's
    ``res`` or for one rank (Ray's own ``CUDA_VISIBLE_DEVICES`` is then the worker's)."""
    if not res.get("GPU") or tp == 1:
        return None
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(num_cpus=0, num_gpus=1)(_gpu_ids)
    refs = [probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
            .remote() for i in range(tp)]
    return [gid for ids in ray.get(refs) for gid in ids]


def _gpu_ids() -> list[str]:
    """The GPU ids Ray gives the task running this (its bundle's)."""
    import ray

    return [str(gid) for gid in ray.get_gpu_ids()]


def format_resources(resources: dict) -> str:
    """``CPU=1,node_a=1`` (sorted; Ray's own ``node:`` and ``bundle_group`` entries and zero
    amounts left out); ``nothing`` when none is left."""
    return ",".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:") and
                    not k.startswith("bundle_group") and v) or "nothing"


def create_groups(ids: list[str], res: dict[str, float], tp: int) -> dict[str, object]:
    """One placement group per worker id: ``tp`` bundles of ``res`` (one rank's), STRICT_PACK.
    Returns at once (Ray places them in the background)."""
    from ray.util.placement_group import placement_group

    return {wid: placement_group([dict(res) for _ in range(tp)], strategy=STRATEGY) for wid in ids}


def wait_placed(groups: dict[str, object], res: dict[str, float], tp: int, timeout_s: float) -> None:
    """Wait until Ray has placed every group of :func:`create_groups` (worker id -> group).

    Raises:
        PlacementError: no live node holds ``tp`` x ``res`` (refused at once), or a group is
            not placed within ``timeout_s`` seconds; the message names the worker, what it
            needed and what the cluster's nodes have.
    """
    import ray

    fmt = format_resources
    need = {k: v * tp for k, v in res.items() if v}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]

    def what(ids, when: str = "") -> str:
        return (f"worker {', '.join(ids)}{when}: {'each' if len(ids) > 1 else 'it'} needs {tp} bundles of "
                f"{fmt(res)} (one a tensor-parallel rank) on one node ({STRATEGY}), {fmt(need)} in all")

    has = "; ".join(sorted({",".join(f"{k}={n.get(k, 0.0):g}" for k in sorted(need)) for n in nodes})) or "none"
    if not any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
        raise PlacementError(f"Ray cannot place {what(list(groups))}; no node has that (the live nodes have "
                             f"{has}; custom resources come from `ray start --resources`)")
    refs = {wid: group.ready() for wid, group in groups.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    late = [wid for wid, ref in refs.items() if ref not in ready]
    if late:
        raise PlacementError(f"Ray could not place {what(late, f' within {timeout_s:g} s')}; the cluster has "
                             f"{fmt(ray.available_resources())} free of {fmt(ray.cluster_resources())}")


def claim_cores(count: int, directory: Path = CLAIMS_DIR) -> tuple[list[int], list]:
    """``count`` cores of this process's (``sched_getaffinity``) for a worker's ranks, and
    the open lock files that hold them (keep them open while the worker runs: closing them,
    or the process ending, frees the cores). Free cores first, in order; when fewer are
    free, cores another worker holds make up the count (logged), and all of this process's
    cores when it has fewer than ``count``. Never raises: a directory that cannot be used
    claims nothing (logged), and the first ``count`` cores are returned."""
    allowed = sorted(os.sched_getaffinity(0))
    held, taken = [], []
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        for core in allowed:
            if len(held) == count:
                break
            lock = open(directory / f"core-{core}", "a")  # noqa: SIM115 (held open: the claim)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                taken.append(core)
                continue
            held.append((core, lock))
    except OSError as exc:
        for _, lock in held:
            lock.close()
        log.warning("cannot claim cores in %s (%s): taking cores %s unclaimed", directory, exc, allowed[:count])
        return allowed[:count], []
    cores = sorted([core for core, _ in held] + taken[:count - len(held)])
    if len(held) < count:
        log.warning("%d cores wanted, %d free here: cores %s (%s shared with other workers)", count, len(held),
                    cores, sorted(set(cores) - {core for core, _ in held}) or "none")
    return cores, [lock for _, lock in held]
