"""Where ``epdserve serve`` puts its workers (rule: docs/serving.md), checked before any starts."""

from __future__ import annotations

import os

from epdserve.argtypes import Options, with_values
from epdserve.serving import flags
from epdserve.serving.deployment import MODE_ROLES, DeploymentSpec, Placement, serve_tp_sizes
from epdserve.serving.worker.ranks import split_cores


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


def plan_for(args: Options) -> Placement:
    """``--cluster ray``: every worker as of one rank (Ray places them; the cores only name them);
    ``--elastic``: workers named ``worker-N``. Raises ValueError as :func:`check_tp_sizes`, or a bad ``--cores``."""
    cores = usable_cores(args.cores)
    check_tp_sizes(args, cores)
    ray = args.cluster == "ray"
    spec = DeploymentSpec.from_serve_args(with_values(args, tensor_parallel_size=None, prefill_tp=None, encode_tp=None,
                                                      decode_tp=None) if ray else args)
    plan = spec.place(cores)
    return [(role, f"worker-{i}", c) for i, (role, _, c) in enumerate(plan)] if args.elastic else plan


def check_tp_sizes(args: Options, cores: list[int]) -> None:
    """Raises ValueError (naming the flag): a per-role ``--*-tp`` outside its modes or with
    ``--elastic``, or (not on Ray) a worker of more ranks than ``cores``."""
    given = [flag.name for flag in flags.ROLE_TP_FLAGS if getattr(args, flag.dest, None) is not None]
    if "--encode-tp" in given and (args.mode != "epd" or args.elastic):
        which = "an elastic" if args.elastic else f"a {args.mode}"
        raise ValueError(f"--encode-tp applies to epd mode; {which} deployment has no encode workers")
    if given and args.elastic:
        raise ValueError(f"{given[0]}: an elastic worker changes role, so every worker takes --tensor-parallel-size")
    if given and args.mode == "colocated":
        raise ValueError(f"{given[0]} applies to pd and epd modes; colocated workers take --tensor-parallel-size")
    sizes = serve_tp_sizes(args)
    for role in MODE_ROLES[args.mode] if args.cluster != "ray" else ():
        flag = f"--{role}-tp" if f"--{role}-tp" in given else "--tensor-parallel-size"
        if sizes[role] > len(cores):
            raise ValueError(f"{flag} {sizes[role]} needs {sizes[role]} cores, one a rank; serve has {len(cores)} "
                             f"({','.join(map(str, cores))}): give it more --cores or use fewer ranks")


def checked_plan(args: Options) -> Placement:
    """:func:`plan_for`; not on Ray, also each worker's cores split among its ranks (ValueError: too few)."""
    plan = plan_for(args)
    if args.cluster != "ray":
        sizes = serve_tp_sizes(args)
        for role, _, cores in plan:
            split_cores(cores, sizes[role])
    return plan
