"""Where ``epdserve serve`` puts its workers (rule: docs/serving.md), checked before any starts."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from epdserve.serving.deployment import MODE_ROLES, Placement
from epdserve.serving.worker.ranks import split_cores

if TYPE_CHECKING:
    from epdserve.serving.launch.options import ServeOptions


def usable_cores(spec: str | None) -> list[int]:
    """Raises ValueError: a core in ``spec`` ("0,1") that is not a number or not this process's."""
    allowed = sorted(os.sched_getaffinity(0))
    if spec is None:
        return allowed
    try:
        cores = [int(c) for c in spec.split(",")]
    except ValueError:
        raise ValueError(f"--cores {spec!r}: expected comma-separated core numbers, e.g. 0,1") from None
    if not set(cores) <= set(allowed):
        raise ValueError(f"--cores {spec!r}: this process may use cores {','.join(map(str, allowed))}")
    return cores


def plan_for(options: ServeOptions) -> Placement:
    """``--cluster ray``: every worker as of one rank (Ray places them; the cores only name them);
    ``--elastic``: workers named ``worker-N``. Raises ValueError as :func:`check_tp_sizes`, or a bad ``--cores``."""
    cores = usable_cores(options.cores)
    check_tp_sizes(options, cores)
    plan = options.deployment(ranks=not options.on_ray).place(cores)
    return [(role, f"worker-{i}", c) for i, (role, _, c) in enumerate(plan)] if options.elastic else plan


def check_tp_sizes(options: ServeOptions, cores: list[int]) -> None:
    """Raises ValueError (naming the flag): a per-role ``--*-tp`` outside its modes or with
    ``--elastic``, or (not on Ray) a worker of more ranks than ``cores``."""
    given = [f"--{role}-tp" for role in ("prefill", "decode", "encode") if options.role(role).tp is not None]
    mode, elastic = options.router.mode, options.elastic
    if "--encode-tp" in given and (mode != "epd" or elastic):
        which = "an elastic" if elastic else f"a {mode}"
        raise ValueError(f"--encode-tp applies to epd mode; {which} deployment has no encode workers")
    if given and elastic:
        raise ValueError(f"{given[0]}: an elastic worker changes role, so every worker takes --tensor-parallel-size")
    if given and mode == "colocated":
        raise ValueError(f"{given[0]} applies to pd and epd modes; colocated workers take --tensor-parallel-size")
    sizes = options.tp_sizes()
    for role in MODE_ROLES[mode] if not options.on_ray else ():
        flag = f"--{role}-tp" if f"--{role}-tp" in given else "--tensor-parallel-size"
        if sizes[role] > len(cores):
            raise ValueError(f"{flag} {sizes[role]} needs {sizes[role]} cores, one a rank; serve has {len(cores)} "
                             f"({','.join(map(str, cores))}): give it more --cores or use fewer ranks")


def checked_plan(options: ServeOptions) -> Placement:
    """:func:`plan_for`; not on Ray, also each worker's cores split among its ranks (ValueError: too few)."""
    plan = plan_for(options)
    if not options.on_ray:
        sizes = options.tp_sizes()
        for role, _, cores in plan:
            split_cores(cores, sizes[role])
    return plan
