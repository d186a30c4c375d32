"""A tensor-parallel worker on Ray (``-tp N``, N > 1): a STRICT_PACK group of N bundles, one a rank, its actor
(rank 0) in bundle 0, and the cores it claims on its node. Placement, GPU and core rules: docs/ray.md.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epdserve.serving.launch.options import ServeOptions

log = logging.getLogger("epdserve.ray")

STRATEGY = "STRICT_PACK"  # a worker's ranks: one node
CLAIMS_DIR = Path(tempfile.gettempdir()) / f"epdserve-cores-{os.getuid()}"


class PlacementError(TimeoutError):
    """Cannot place a tensor-parallel worker's group; a TimeoutError, so serve reports it as one line, exit 1."""


def ranked(options: ServeOptions) -> bool:
    return max(options.tp_sizes().values()) > 1


def check_options(options: ServeOptions) -> None:
    """Raises ValueError: a worker of several ranks with a ``--worker-placement`` other than PACK."""
    if not ranked(options):
        return
    role, tp = max(options.tp_sizes().items(), key=lambda item: item[1])
    flag = f"--{role}-tp" if options.role(role).tp else "--tensor-parallel-size"
    if options.ray.worker_placement != "PACK":
        raise ValueError(f"--worker-placement {options.ray.worker_placement} with {flag} {tp} on Ray: each "
                         f"worker is a placement group of its own ({tp} bundles, {STRATEGY}: its ranks on one node) "
                         "and Ray places the groups; leave --worker-placement at PACK")


def check_gpus(res: dict[str, float], tp: int, option: str) -> None:
    """Raises ValueError: ``tp`` > 1 with a ``GPU`` amount other than 0 or 1 (a rank runs on one whole GPU)."""
    gpus = res.get("GPU", 0.0)
    if tp > 1 and gpus not in (0.0, 1.0):
        raise ValueError(f"{option} GPU={gpus:g} with {tp} tensor-parallel ranks on Ray: each rank runs on one "
                         "whole GPU of its own bundle (give GPU=1, or no GPU for a CPU worker)")


def bundle_gpus(group, tp: int, res: dict[str, float]) -> list[str] | None:
    """GPU ids Ray reserved for bundles 0..tp-1, read by a probe task in each (an actor sees only its own
    bundle's); None without GPUs or for one rank."""
    if not res.get("GPU") or tp == 1:
        return None
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(num_cpus=0, num_gpus=1)(_gpu_ids)
    refs = [probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i))
            .remote() for i in range(tp)]
    return [gid for ids in ray.get(refs) for gid in ids]


def _gpu_ids() -> list[str]:
    import ray

    return [str(gid) for gid in ray.get_gpu_ids()]


def format_resources(resources: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:") and
                    not k.startswith("bundle_group") and v) or "nothing"


def create_groups(ids: list[str], res: dict[str, float], tp: int) -> dict[str, object]:
    """Returns at once: Ray places the groups in the background."""
    from ray.util.placement_group import placement_group

    return {wid: placement_group([dict(res) for _ in range(tp)], strategy=STRATEGY) for wid in ids}


def wait_placed(groups: dict[str, object], res: dict[str, float], tp: int, timeout_s: float) -> None:
    """Raises PlacementError: no live node can hold ``tp`` x ``res`` (at once), or a group is not placed
    within ``timeout_s`` seconds."""
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
    """``count`` cores (free first; held ones make up a shortfall, logged) and the ``flock``-ed files that hold
    them until closed or this process ends. Never raises: an unusable ``directory`` claims nothing."""
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
