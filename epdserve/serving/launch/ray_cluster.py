"""``epdserve serve --cluster ray``: each worker a Ray actor on an existing cluster, the router in the driver.
Resources, placement groups, addresses, supervision and stop: docs/ray.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import asyncio
import re
import signal
import socket
import time
from typing import TYPE_CHECKING

from epdserve.argtypes import config_from
from epdserve.serving.launch import ray_ranks
from epdserve.serving.launch.ray_ranks import format_resources as _format

if TYPE_CHECKING:
    from epdserve.serving.launch.options import ServeOptions

log = logging.getLogger("epdserve.ray")

CLUSTERS = ("local", "ray")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies
# The option prefix of each role's Ray resources and placement (colocated workers: "worker").
ROLE_OPTION = {"colocated": "worker", "prefill": "prefill", "decode": "decode", "encode": "encode"}

_RESOURCE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]*")
PR_SET_PDEATHSIG = 1  # prctl(2)
STOP_GRACE_S = 5.0  # s from Shutdown to killing the actors


def parse_resources(text: str, option: str) -> dict[str, float]:
    """``"CPU=1,node_a=1"`` as ``{"CPU": 1.0, "node_a": 1.0}`` (CPU default 1); ValueError names ``option``."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, eq, amount = item.strip().partition("=")
        bad = f"{option} {text!r}: {item.strip()!r}"
        if not eq or not _RESOURCE_NAME.fullmatch(name.strip()):
            raise ValueError(f"{bad} is not NAME=AMOUNT (e.g. CPU=1,prefill_node=1)")
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"{bad}: the amount is not a number") from None
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{bad}: the amount must be a finite number >= 0")
        if name.strip() in out:
            raise ValueError(f"{bad}: {name.strip()} is given twice")
        out[name.strip()] = value
    out.setdefault("CPU", 1.0)
    return out


def role_resources(options: ServeOptions) -> dict[str, dict[str, float]]:
    """Raises ValueError: a bad ``--*-resources``, or tensor-parallel options Ray cannot place (:mod:`.ray_ranks`)."""
    ray_ranks.check_options(options)
    sizes = options.tp_sizes()
    out = {}
    for role in ROLE_OPTION:
        text, flag = options.ray.resources(role)
        out[role] = parse_resources(text, flag)
        ray_ranks.check_gpus(out[role], sizes[role], flag)
    return out


class WorkerActor:
    """One worker as a Ray actor, running ``epdserve worker`` in its process. ``argv`` lacks ``--bind`` and
    ``--kv-bind`` (this node's IP); ``num_threads``: torch threads (the actor's CPUs); ``ranks`` > 1: claims
    ``ranks x num_threads`` cores of this node while it lives; ``gpus``: all its ranks' ``CUDA_VISIBLE_DEVICES``."""

    def __init__(self, argv: list[str], env: dict[str, str], num_threads: int, ranks: int = 1,
                 gpus: list[str] | None = None):
        import ray

        _die_with_raylet()
        context = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        resources = {k: float(v) * ranks for k, v in context.get_assigned_resources().items()}
        self.claims: list = []  # held open while this process lives: its cores
        if ranks > 1:
            cores, self.claims = ray_ranks.claim_cores(ranks * num_threads)
            argv = [*argv, "--cores", ",".join(map(str, cores))]
        os.environ.update(env, EPDSERVE_NODE_ID=context.get_node_id(), EPDSERVE_NODE_IP=ip,
                          EPDSERVE_NODE_RESOURCES=json.dumps(resources), EPDSERVE_NUM_THREADS=str(num_threads),
                          PYTHONUNBUFFERED="1")
        if gpus:  # before anything initializes CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        host = f"[{ip}]" if ":" in ip else ip
        self.argv = [*argv, "--bind", f"tcp://{host}:0", "--kv-bind", f"tcp://{host}:0"]

    def run(self) -> int:
        """Exit status: 0, or 2 for a bad option or model or a refusal by the router."""
        from epdserve.serving.worker import engine_worker as worker

        parser = argparse.ArgumentParser(prog="epdserve worker")
        worker.add_arguments(parser)
        return worker.run(config_from(worker.OPTIONS, parser.parse_args(self.argv)))


def _die_with_raylet() -> None:
    """SIGKILL this actor when its parent, the raylet, dies (``PR_SET_PDEATHSIG``): sooner than Ray's 3-4 s."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: Ray's fate-sharing applies
    if os.getppid() == 1:  # the raylet died before prctl took effect
        os._exit(1)


def events_address() -> str:
    """``tcp://IP:PORT``: this driver's Ray node IP (reachable by the nodes) and a free port."""
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class RayWorkers:
    """The workers as Ray actors, as :class:`~.children.Children` runs them locally; elastic, also the
    router's :class:`~epdserve.serving.router.elastic.Scaler` once ``command`` is set."""

    restart_note = "Ray restarts it"

    def __init__(self, options: ServeOptions, env: dict[str, str]):
        self.options = options
        self.env = env
        self.resources = role_resources(options)
        self.actors: dict[str, object] = {}
        self.runs: dict[str, object] = {}
        self.groups: list = []
        self.connected = False
        self.draining = False  # set by drain: runs that end now end on purpose
        self.actor_cls = None
        self.command = None  # elastic: (role, worker id) -> the flags of a worker to add
        self.next_index = 0  # of the next worker-K added: ids are never reused
        self.own_groups: dict[str, object] = {}
        self.pending: dict[str, asyncio.Task] = {}

    def connect(self) -> None:
        """Join the cluster, never start one. Raises ConnectionError: none at ``--ray-address``."""
        import ray

        address = self.options.ray.ray_address
        _check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConnectionError(f"--ray-address {address}: cannot join a Ray cluster: {exc}") from None
        self.connected = True

    def _option_role(self, role: str) -> str:
        return "colocated" if self.options.elastic else role

    def placement(self, plan) -> str:
        if ray_ranks.ranked(self.options):
            sizes = self.options.tp_sizes()
            return ", ".join(f"{wid} on Ray ({sizes[role]} rank{'s' if sizes[role] > 1 else ''} of "
                             f"{_format(self.resources[self._option_role(role)])}, {ray_ranks.STRATEGY})"
                             for role, wid, _ in plan)
        return ", ".join(f"{wid} on Ray ({_format(self.resources[self._option_role(role)])}, "
                         f"{self.options.ray.placement(self._option_role(role))})"
                         for role, wid, _ in plan)

    def launch(self, plan, argv: dict[str, list[str]]) -> None:
        """A placement group per role, an actor per bundle (``plan``'s cores are ignored). Raises
        TimeoutError: a group not placed within ``--startup-timeout`` (tensor-parallel: PlacementError)."""
        import ray
        from ray.util.placement_group import placement_group

        self.next_index = len(plan)
        if ray_ranks.ranked(self.options):
            return self._launch_ranked(plan, argv)
        for role in dict.fromkeys(self._option_role(r) for r, _, _ in plan):
            ids = [wid for r, wid, _ in plan if self._option_role(r) == role]
            res = self.resources[role]
            strategy = self.options.ray.placement(role)
            group = placement_group([dict(res) for _ in ids], strategy=strategy)
            self.groups.append(group)
            ready, _ = ray.wait([group.ready()], timeout=self.options.startup_timeout)
            if not ready:
                raise TimeoutError(f"Ray could not place {len(ids)} {role} worker(s) of {_format(res)} ({strategy}) "
                                   f"within {self.options.startup_timeout:g} s; the cluster has "
                                   f"{_format(ray.cluster_resources())} (custom resources come from "
                                   f"`ray start --resources`)")
            for index, wid in enumerate(ids):
                self._start_actor(wid, group, index, argv[wid], res)

    def _launch_ranked(self, plan, argv: dict[str, list[str]]) -> None:
        """A group per worker (one bundle a rank), the actors on bundle 0 once every group is placed."""
        sizes, placed = self.options.tp_sizes(), []
        for role in dict.fromkeys(r for r, _, _ in plan):
            tp, res = sizes[role], self.resources[self._option_role(role)]
            groups = ray_ranks.create_groups([wid for r, wid, _ in plan if r == role], res, tp)
            self.groups.extend(groups.values())  # before the wait: stop() removes them whatever happens
            placed.append((groups, res, tp))
        for groups, res, tp in placed:
            ray_ranks.wait_placed(groups, res, tp, self.options.startup_timeout)
        for groups, res, tp in placed:
            for wid, group in groups.items():
                gpus = ray_ranks.bundle_gpus(group, tp, res)
                self._start_actor(wid, group, 0, argv[wid], res, ranks=tp, gpus=gpus)

    def _start_actor(self, wid: str, group, index: int, argv: list[str], res: dict[str, float],
                     ranks: int = 1, gpus: list[str] | None = None) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        if self.actor_cls is None:
            self.actor_cls = ray.remote(WorkerActor)
        actor = self.actor_cls.options(
            num_cpus=res["CPU"], num_gpus=res.get("GPU", 0), resources=custom, max_restarts=-1,
            max_task_retries=-1, max_concurrency=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote(argv, self.env, max(1, int(res["CPU"])), ranks, gpus)
        self.actors[wid] = actor
        self.runs[wid] = actor.run.remote()
        log.info("started worker %s as a Ray actor (%s%s%s)", wid, f"{ranks} ranks of " if ranks > 1 else "",
                 _format(res), f"; GPUs {','.join(gpus)}" if gpus else "")

    def add(self, role: str) -> str:
        """Elastic: start ``worker-K`` (K never reused) in a placement group of its own, in the background.
        Call from the router's event loop. Raises RuntimeError: ``command`` not set."""
        from ray.util.placement_group import placement_group

        if self.command is None:
            raise RuntimeError("workers are added only by an elastic serve")
        wid = f"worker-{self.next_index}"
        self.next_index += 1
        res, tp = self.resources["colocated"], self.options.tp_sizes()["colocated"]
        group = (ray_ranks.create_groups([wid], res, tp)[wid] if tp > 1
                 else placement_group([dict(res)], strategy=self.options.ray.worker_placement))
        self.own_groups[wid] = group
        self.pending[wid] = asyncio.get_running_loop().create_task(
            self._start_when_placed(wid, group, self.command(role, wid), res, tp))
        log.info("adding worker %s (%s) as a Ray actor (%s): waiting for its placement", wid, role, _format(res))
        return wid

    async def _start_when_placed(self, wid: str, group, argv: list[str], res: dict[str, float], tp: int) -> None:
        import ray

        ready = group.ready()
        while not ray.wait([ready], timeout=0)[0]:
            await asyncio.sleep(0.5)
        gpus = await asyncio.to_thread(ray_ranks.bundle_gpus, group, tp, res)
        self.pending.pop(wid, None)
        self._start_actor(wid, group, 0, argv, res, ranks=tp, gpus=gpus)

    def remove(self, worker_id: str) -> None:
        """Elastic: kill the actor once its run ended or after :data:`STOP_GRACE_S`, and remove an added
        worker's group. Never raises."""
        task = self.pending.pop(worker_id, None)
        if task is not None:
            task.cancel()
        run, actor = self.runs.pop(worker_id, None), self.actors.pop(worker_id, None)
        group = self.own_groups.pop(worker_id, None)
        if actor is not None or group is not None:
            asyncio.get_running_loop().create_task(self._stop_later(worker_id, run, actor, group))

    async def _stop_later(self, worker_id: str, run, actor, group) -> None:
        import ray

        deadline = time.monotonic() + STOP_GRACE_S
        while run is not None and not ray.wait([run], timeout=0)[0] and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        try:
            if actor is not None:
                ray.kill(actor, no_restart=True)
            if group is not None:
                ray.util.remove_placement_group(group)
            log.info("worker %s: its Ray actor is stopped%s", worker_id, " and its placement group removed"
                     if group is not None else "")
        except Exception as exc:  # noqa: BLE001 (a cluster gone meanwhile: nothing left to stop there)
            log.warning("stopping worker %s's Ray actor: %s", worker_id, exc)

    def ids(self) -> list[str]:
        return list(self.actors)

    def exits(self) -> list[tuple[str, str, bool]]:
        """Runs ended since the last call, all fatal; a process Ray restarts is not one (its run is
        retried; the router notices the silence)."""
        import ray

        if self.draining or not self.runs:
            return []
        done, _ = ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)
        out = []
        for wid in [w for w, ref in self.runs.items() if ref in done]:
            ref = self.runs.pop(wid)
            try:
                out.append((wid, f"Ray actor's worker exited with code {ray.get(ref)}", True))
            except ray.exceptions.RayError as exc:
                out.append((wid, f"Ray actor failed: {str(exc).splitlines()[0]}", True))
        return out

    def drain(self, router) -> None:
        """Shut the workers down through ``router`` (they free their shared memory), waiting up to
        :data:`STOP_GRACE_S`; before the router closes its sockets. Never raises."""
        import ray

        self.draining = True
        try:
            router.shutdown_workers()
            if self.runs:
                ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=STOP_GRACE_S)
        except Exception as exc:  # noqa: BLE001 (best effort: stop() kills the actors anyway)
            log.warning("asking the Ray workers to shut down: %s", exc)

    def stop(self) -> None:
        """Kill every actor, remove the groups, disconnect (the cluster keeps running). Idempotent; never raises."""
        import ray

        if not self.connected:
            return
        for task in self.pending.values():
            task.cancel()
        try:
            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
            for group in [*self.groups, *self.own_groups.values()]:
                ray.util.remove_placement_group(group)
        except Exception as exc:  # noqa: BLE001 (a cluster gone meanwhile: nothing left to stop there)
            log.warning("stopping the Ray actors: %s", exc)
        finally:
            self.actors.clear()
            self.runs.clear()
            self.groups.clear()
            self.own_groups.clear()
            self.pending.clear()
            ray.shutdown()
            self.connected = False


def before_router_stops(app, hook):
    """``app`` calling ``hook()`` at lifespan shutdown: after uvicorn's graceful wait, before the
    router closes its sockets (through which Ray's workers are told to shut down)."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)

        async def receive_then_hook():
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                hook()
            return message
        return await app(scope, receive_then_hook, send)
    return wrapped


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast where nothing listens at ``HOST:PORT`` (``ray.init`` would retry for minutes); "auto"
    and ``ray://`` are Ray's. Raises ConnectionError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"--ray-address {address}: cannot join a Ray cluster: nothing answers there "
                              f"({exc.strerror or exc}); start one with `ray start --head` or give its GCS "
                              f"address") from None
