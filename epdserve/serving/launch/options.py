"""``epdserve serve``'s options: the router's, the worker flags it passes on, and its own (worker
counts, per-role settings, the Ray cluster's), each field its flag (``argtypes.setting``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from epdserve.argtypes import field_of, float_above, int_at_least, nested, passed_to_workers, setting
from epdserve.engine.config import DEVICE_METAVAR, DTYPE_CHOICES, device_type
from epdserve.model.kv_cache_dtype import KV_CACHE_DTYPES
from epdserve.model.linear import WEIGHT_FORMATS, auto_format
from epdserve.serving import flags
from epdserve.serving.deployment import DeploymentSpec
from epdserve.serving.launch.ray_cluster import CLUSTERS, ROLE_OPTION, STRATEGIES
from epdserve.serving.router.options import RouterOptions
from epdserve.serving.worker.setup import WORKER_FLAGS, worker_default


def _resources(role: str):
    elastic = "; every --elastic worker takes these, whatever its role" if role == "colocated" else ""
    return field(default="CPU=1", metadata=setting(
        f"--cluster ray: Ray resources of each {role} worker, e.g. CPU=1,GPU=1,{role}_node=1 (custom resources name "
        f"the nodes given them at ray start){elastic}", metavar="K=V,..."))


def _placement(role: str):
    elastic = "; of every --elastic worker" if role == "colocated" else ""
    return field(default="PACK", metadata=setting(
        f"--cluster ray: Ray placement-group strategy of the {role} workers{elastic}", type=str.upper,
        choices=STRATEGIES))


@dataclass(frozen=True)
class RayOptions:
    """Where serve's workers run: this host, or a Ray cluster (docs/ray.md)."""
    cluster: str = field(default="local", metadata=setting(
        "local: workers are subprocesses on this host; ray: Ray actors on the Ray cluster at --ray-address (see "
        "docs/ray.md)", choices=CLUSTERS))
    ray_address: str = field(default="auto", metadata=setting(
        "--cluster ray: the cluster to join, as ray.init's address (default: auto, the cluster started on this "
        "host by `ray start`)"))
    worker_resources: str = _resources("colocated")
    worker_placement: str = _placement("colocated")
    prefill_resources: str = _resources("prefill")
    prefill_placement: str = _placement("prefill")
    decode_resources: str = _resources("decode")
    decode_placement: str = _placement("decode")
    encode_resources: str = _resources("encode")
    encode_placement: str = _placement("encode")

    def resources(self, role: str) -> tuple[str, str]:
        """``(--ROLE-resources value, its flag)`` of a role's workers."""
        option = ROLE_OPTION[role]
        return getattr(self, f"{option}_resources"), f"--{option}-resources"

    def placement(self, role: str) -> str:
        return getattr(self, f"{ROLE_OPTION[role]}_placement")


@dataclass(frozen=True)
class RoleSettings:
    """What serve's ``--ROLE-*`` flags give one role's workers; None: the common flag's value."""
    tp: int | None = None
    dtype: str | None = None
    weight_format: str | None = None
    kv_cache_dtype: str | None = None
    device: str | None = None


def _weight_format(role: str):
    return field(default=None, metadata=setting(
        f"pd: the weight format of the {role} workers (default: --weight-format; its auto already gives them "
        f"{auto_format(role == 'prefill', role == 'decode')})", choices=WEIGHT_FORMATS))


def _kv_cache_dtype(role: str):
    return field(default=None, metadata=setting(
        f"pd: the KV cache dtype of the {role} workers (default: --kv-cache-dtype; a hand-off converts between the "
        "two)", choices=KV_CACHE_DTYPES))


def _device(role: str):
    return field(default=None, metadata=setting(
        f"pd, epd: the device of the {role} workers (default: --device; docs/gpu.md)", type=device_type,
        metavar=DEVICE_METAVAR))


def _workers(help: str, *names: str):
    return field(default=1, metadata=setting(help, *names, type=int_at_least(1)))


@dataclass(frozen=True)
class ServeOptions:
    """``epdserve serve``'s options. ``worker``: the worker flags given (by dest; absent: not
    given, the worker's own default holds), passed to each worker."""
    router: RouterOptions = nested(RouterOptions)
    model_tag: str | None = field(default=None, metadata=setting(
        "the model to serve, as in `vllm serve MODEL`: the same as --model", "model_tag", nargs="?",
        metavar="MODEL"))
    cores: str | None = field_of(flags.CORES_FLAG)
    worker: dict[str, object] = passed_to_workers(WORKER_FLAGS)
    prefill_tp: int | None = field_of(flags.ROLE_TP_FLAGS[0])
    decode_tp: int | None = field_of(flags.ROLE_TP_FLAGS[1])
    encode_tp: int | None = field_of(flags.ROLE_TP_FLAGS[2])
    prefill_dtype: str | None = field(default=None, metadata=setting(
        "pd: weights and KV cache dtype of the prefill workers (default: --dtype)", choices=DTYPE_CHOICES))
    decode_dtype: str | None = field(default=None, metadata=setting(
        "pd: weights and KV cache dtype of the decode workers, which convert imported KV to it (default: --dtype)",
        choices=DTYPE_CHOICES))
    prefill_weight_format: str | None = _weight_format("prefill")
    prefill_kv_cache_dtype: str | None = _kv_cache_dtype("prefill")
    decode_weight_format: str | None = _weight_format("decode")
    decode_kv_cache_dtype: str | None = _kv_cache_dtype("decode")
    prefill_device: str | None = _device("prefill")
    decode_device: str | None = _device("decode")
    encode_device: str | None = _device("encode")
    startup_timeout: float = field(default=900.0, metadata=setting(
        "seconds to wait for every worker's hello", type=float_above(0)))
    workers: int = _workers("colocated: number of worker replicas (vLLM's --data-parallel-size)",
                            "--workers", "--data-parallel-size", "-dp")
    prefill_workers: int = _workers("pd, epd: number of prefill workers")
    decode_workers: int = _workers("pd, epd: number of decode workers")
    encode_workers: int = _workers("epd: number of encode workers")
    max_workers: int | None = field(default=None, metadata=setting(
        "--elastic: at most this many engine workers; the starting ones are the minimum and the controller (or POST "
        "/workers, DELETE /workers/ID) adds and retires workers in between (default: the starting count, no "
        "scaling; above it needs --cluster ray; docs/elastic.md)", type=int_at_least(1), metavar="N"))
    allow_oversubscription: bool = field_of(flags.ALLOW_OVERSUBSCRIPTION_FLAG)
    events: str | None = field_of(flags.EVENTS_FLAG)
    ray: RayOptions = nested(RayOptions)

    @property
    def elastic(self) -> bool:
        return self.router.elastic.elastic

    @property
    def on_ray(self) -> bool:
        return self.ray.cluster == "ray"

    def role(self, role: str) -> RoleSettings:
        """The ``--ROLE-*`` flags given for ``role``'s workers."""
        return RoleSettings(**{f.name: getattr(self, f"{role}_{f.name}", None) for f in fields(RoleSettings)})

    def tp_sizes(self) -> dict[str, int]:
        """Tensor-parallel ranks of each role's workers: ``-tp`` (colocated, and prefill and
        decode unless ``--prefill-tp`` / ``--decode-tp``); encode: ``--encode-tp`` or 1."""
        tp = self.worker.get("tensor_parallel_size") or 1
        return {"colocated": tp, "encode": self.encode_tp or 1, "prefill": self.prefill_tp or tp,
                "decode": self.decode_tp or tp}

    @property
    def kv_cache_memory_mb(self) -> int:
        return self.worker.get("kv_cache_memory_mb") or worker_default("kv_cache_memory_mb")

    def deployment(self, ranks: bool = True) -> DeploymentSpec:
        """The deployment these options place; ``ranks`` False: every worker of one rank (on Ray,
        which places a worker's ranks itself). Raises ValueError as ``DeploymentSpec.placed``."""
        counts = {"colocated": self.workers, "encode": self.encode_workers, "prefill": self.prefill_workers,
                  "decode": self.decode_workers}
        sizes = self.tp_sizes() if ranks else dict.fromkeys(counts, 1)
        return DeploymentSpec.placed(self.router.mode, counts, sizes, self.router.local_prefill_threshold,
                                     self.worker.get("enable_prefix_caching") is not False, self.elastic)
