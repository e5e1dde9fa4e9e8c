"""The InferenceDeployment spec as dataclasses, with defaults and validation.

The CRD (charts/splitserve/crds/) applies the same defaults server-side and its CEL
rules reject most bad specs at `kubectl apply`. `parse_spec` repeats every CEL rule
here because (a) jsonschema-based tests cannot run CEL, and (b) an API server without
CEL support (or an object written before a rule existed) must still end in a Degraded
condition naming the field, never in a crash loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.core.hashing import DEFAULT_BLOCK_SIZE

from .cert_manager import IssuerRef, parse_tls
from .labels import label_problems
from .spec_compatibility import compatibility_problems
from .spec_fields import bool_field, float_field, int_field, object_field
from .spec_kv_offload import KVOffloadSpec, parse_kv_offload
from .spec_lora import LoRASpec, parse_loras
from .spec_model import ModelSpec, SecretRef, parse_model, parse_secret_ref
from .spec_pod import PodSettings, parse_pod_settings
from .spec_speculative import speculative_flag

# engine/kv_cache.py's KV_CACHE_DTYPES, repeated: the operator never imports the engine (torch);
# tests/operator/test_kv_cache_dtype.py keeps the two equal
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

GROUP = "splitserve.io"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
MAX_NAME_LENGTH = 40  # leaves room for "-prefill-worker-xxxxx" suffixes in pod names


class SpecError(ValueError):
    """An invalid or unsatisfiable spec; `problems` lists every offending field."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class RoleSpec:
    replicas: int
    min_replicas: int
    max_replicas: int
    resources: dict = field(default_factory=dict)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    pod: PodSettings = field(default_factory=PodSettings)
    kv_cache_memory_gib: float | None = None  # None: the engine's default
    tensor_parallel_size: int = 1  # ranks each worker shards the model over (--tensor-parallel-size)
    kv_offload: KVOffloadSpec = field(default_factory=KVOffloadSpec)  # host / disk KV tiers (spec_kv_offload.py)

    @property
    def gpus(self) -> int:
        """GPUs per pod, from resources (limits win); decides --device cuda vs cpu."""
        for section in ("limits", "requests"):
            value = (self.resources.get(section) or {}).get("nvidia.com/gpu")
            if value is not None:
                return int(value)
        return 0


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 2
    resources: dict = field(default_factory=dict)
    service_type: str = "ClusterIP"
    stream_interval: int = 1  # the router's --stream-interval
    strict_disaggregation: bool = False  # the router's --strict-disaggregation
    pod: PodSettings = field(default_factory=PodSettings)


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = True
    target_waiting_per_replica: float = 4.0
    low_watermark: float = 0.5
    scale_up_window_seconds: int = 60
    scale_down_window_seconds: int = 300
    max_step: int = 2
    stale_after_seconds: int = 30
    # Scale to zero (spec.decode.minReplicas 0): idle this long before the last replica goes;
    # meanwhile routers hold up to holdRequestsAtZero requests, each holdTimeoutSeconds at most.
    scale_to_zero_after_seconds: int = 600
    hold_requests_at_zero: int = 100
    hold_timeout_seconds: int = 300


@dataclass(frozen=True)
class InferenceSpec:
    name: str
    namespace: str
    image: str
    image_pull_policy: str
    model: ModelSpec
    router: RouterSpec
    prefill: RoleSpec
    decode: RoleSpec
    autoscaling: AutoscalingSpec
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"  # spec.engine.kvCacheDtype: every worker's --kv-cache-dtype
    speculative: str = ""  # spec.engine.speculative as the decode workers' --speculative-config JSON; "": off
    async_scheduling: bool = False  # spec.engine.asyncScheduling: the decode workers' --async-scheduling
    # spec.engine.expertParallel: --enable-expert-parallel on the roles with tensorParallelSize > 1
    expert_parallel: bool = False
    fp8_activations: str = "auto"  # spec.engine.fp8Activations: every worker's --fp8-activations
    loras: LoRASpec = field(default_factory=LoRASpec)  # spec.loras: adapters both worker roles load (spec_lora.py)
    kv_backend: str = "grpc"
    rdma_device: str = ""
    redis_url: str = ""  # empty and no redis_url_secret: the operator deploys an in-cluster Redis
    redis_url_secret: SecretRef | None = None  # the external Redis URL, from a Secret
    redis_image: str = "redis:7.4-alpine"
    service_monitor: bool = False
    pod_monitor: bool = False
    scrape_interval: str = "15s"
    monitor_labels: dict = field(default_factory=dict)  # extra labels on the monitors
    network_policy: bool = True
    drain_timeout_seconds: int = 600
    prefill_timeout_seconds: float = 30.0  # spec.decode.prefillTimeoutSeconds: the decode workers' --prefill-timeout
    image_pull_secrets: tuple[str, ...] = ()
    tls_issuer: IssuerRef | None = None  # spec.tls.certManager: mutual TLS from cert-manager (cert_manager.py)
    cluster_token_hash: str = ""  # of the token Secret, set at reconcile (cluster_token.py): rolls the pods

    @property
    def cluster_token_secret(self) -> str:
        """The Secret holding this deployment's cluster token (created by the operator)."""
        return f"{self.name}-cluster-token"

    @property
    def cluster(self) -> str:
        """Cluster-bus name: every Redis key of this deployment starts with it."""
        return f"{self.namespace}.{self.name}"

    @property
    def external_redis(self) -> bool:
        return bool(self.redis_url or self.redis_url_secret)

    @property
    def effective_redis_url(self) -> str:
        """The URL as the spec says it; with redis_url_secret, only the Secret knows it."""
        return self.redis_url or f"redis://{self.name}-redis.{self.namespace}.svc:6379/0"


def _role(d: dict, where: str, problems: list[str], replicas: int, maximum: int, lowest_min: int = 1) -> RoleSpec:
    role = RoleSpec(
        replicas=int_field(d, "replicas", replicas, where, problems, minimum=1),
        min_replicas=int_field(d, "minReplicas", 1, where, problems, minimum=lowest_min),
        max_replicas=int_field(d, "maxReplicas", maximum, where, problems, minimum=1),
        resources=d.get("resources", {}) or {},
        max_num_batched_tokens=int_field(d, "maxNumBatchedTokens", 8192, where, problems, minimum=1),
        max_num_seqs=int_field(d, "maxNumSeqs", 256, where, problems, minimum=1),
        pod=parse_pod_settings(d, where, problems),
        kv_cache_memory_gib=float_field(d, "kvCacheMemoryGiB", 0.0, where, problems) or None,
        tensor_parallel_size=int_field(d, "tensorParallelSize", 1, where, problems, minimum=1),
        kv_offload=parse_kv_offload(d, where, problems),
    )
    if role.kv_cache_memory_gib is not None and role.kv_cache_memory_gib <= 0:
        problems.append(f"{where}.kvCacheMemoryGiB must be > 0")
    try:
        role.gpus  # noqa: B018 - validates the quantity
    except (TypeError, ValueError):
        problems.append(f"{where}.resources nvidia.com/gpu must be a whole number")
    else:
        tp = role.tensor_parallel_size
        if tp > 1 and role.gpus % tp:
            problems.append(f"{where}.resources nvidia.com/gpu ({role.gpus}) must be a multiple of "
                            f"{where}.tensorParallelSize ({tp}): one GPU per rank")
    # The CRD's CEL rules, repeated (see module docstring).
    if role.min_replicas > role.max_replicas:
        problems.append(f"{where}.minReplicas ({role.min_replicas}) must be <= "
                        f"{where}.maxReplicas ({role.max_replicas})")
    elif not role.min_replicas <= role.replicas <= role.max_replicas:
        problems.append(f"{where}.replicas ({role.replicas}) must lie within "
                        f"[minReplicas, maxReplicas] = [{role.min_replicas}, {role.max_replicas}]")
    return role


def parse_spec(name: str, namespace: str, spec: dict[str, Any], default_image: str) -> InferenceSpec:
    """Spec dict (as stored, defaults possibly missing) -> InferenceSpec, or SpecError."""
    problems: list[str] = []
    if not isinstance(spec, dict):
        raise SpecError([f"spec must be an object, got {type(spec).__name__}"])
    if len(name) > MAX_NAME_LENGTH:
        problems.append(f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child names append suffixes)")
    model = parse_model(object_field(spec, "model", problems), problems)
    router_d = object_field(spec, "router", problems)
    router = RouterSpec(replicas=int_field(router_d, "replicas", 2, "spec.router", problems, minimum=1),
                        resources=router_d.get("resources", {}) or {},
                        service_type=str(router_d.get("serviceType", "ClusterIP")),
                        stream_interval=int_field(router_d, "streamInterval", 1, "spec.router", problems, minimum=1),
                        strict_disaggregation=bool_field(router_d, "strictDisaggregation", False, "spec.router",
                                                         problems),
                        pod=parse_pod_settings(router_d, "spec.router", problems))
    if router.service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        problems.append(f"spec.router.serviceType must be ClusterIP, NodePort or LoadBalancer, got {router.service_type!r}")
    prefill = _role(object_field(spec, "prefill", problems), "spec.prefill", problems, 1, 4)
    decode_d = object_field(spec, "decode", problems)
    decode = _role(decode_d, "spec.decode", problems, 1, 4, lowest_min=0)  # 0: scale to zero (decode only)
    drain_timeout = int_field(decode_d, "drainTimeoutSeconds", 600, "spec.decode", problems, minimum=1)
    prefill_timeout = float_field(decode_d, "prefillTimeoutSeconds", 30.0, "spec.decode", problems)
    if not 1 <= prefill_timeout <= 600:  # a prefill worker accepts pushes up to 600 s
        problems.append(f"spec.decode.prefillTimeoutSeconds must be in [1, 600], got {prefill_timeout:g}")
    if decode.max_num_batched_tokens < decode.max_num_seqs:
        problems.append(f"spec.decode.maxNumBatchedTokens ({decode.max_num_batched_tokens}) must be >= "
                        f"spec.decode.maxNumSeqs ({decode.max_num_seqs})")
    a = object_field(spec, "autoscaling", problems)
    autoscaling = AutoscalingSpec(
        enabled=bool(a.get("enabled", True)),
        target_waiting_per_replica=float_field(a, "targetWaitingPerReplica", 4.0, "spec.autoscaling", problems),
        low_watermark=float_field(a, "lowWatermark", 0.5, "spec.autoscaling", problems),
        scale_up_window_seconds=int_field(a, "scaleUpWindowSeconds", 60, "spec.autoscaling", problems),
        scale_down_window_seconds=int_field(a, "scaleDownWindowSeconds", 300, "spec.autoscaling", problems),
        max_step=int_field(a, "maxStep", 2, "spec.autoscaling", problems, minimum=1),
        stale_after_seconds=int_field(a, "staleAfterSeconds", 30, "spec.autoscaling", problems, minimum=1),
        scale_to_zero_after_seconds=int_field(a, "scaleToZeroAfterSeconds", 600, "spec.autoscaling", problems,
                                              minimum=0),
        hold_requests_at_zero=int_field(a, "holdRequestsAtZero", 100, "spec.autoscaling", problems, minimum=1),
        hold_timeout_seconds=int_field(a, "holdTimeoutSeconds", 300, "spec.autoscaling", problems, minimum=1))
    if decode.min_replicas == 0 and not autoscaling.enabled:  # also a CEL rule of the CRD
        problems.append("spec.decode.minReplicas 0 (scale to zero) needs spec.autoscaling.enabled: nothing "
                        "would scale decode up again")
    if autoscaling.target_waiting_per_replica <= 0:
        problems.append("spec.autoscaling.targetWaitingPerReplica must be > 0")
    if not 0 < autoscaling.low_watermark < 1:
        problems.append("spec.autoscaling.lowWatermark must lie strictly between 0 and 1")
    tls_issuer = parse_tls(object_field(spec, "tls", problems), problems)
    kv = object_field(spec, "kvTransfer", problems)
    kv_backend, rdma_device = str(kv.get("backend", "grpc")), str(kv.get("rdmaDevice", ""))
    if kv_backend not in ("grpc", "mooncake"):
        problems.append(f"spec.kvTransfer.backend must be grpc or mooncake, got {kv_backend!r}")
    if rdma_device and kv_backend != "mooncake":
        problems.append("spec.kvTransfer.rdmaDevice is only used by the mooncake backend; set backend: mooncake")
    redis = object_field(spec, "redis", problems)
    redis_url = str(redis.get("url", ""))
    redis_url_secret = parse_secret_ref(redis, "urlSecretRef", "spec.redis", problems)
    if redis_url and not redis_url.startswith(("redis://", "rediss://")):
        problems.append(f"spec.redis.url must start with redis:// or rediss://, got {redis_url!r}")
    if redis_url and redis_url_secret:
        problems.append("spec.redis.url and redis.urlSecretRef are mutually exclusive: keep the URL in the "
                        "Secret and leave url unset")
    monitoring = object_field(spec, "monitoring", problems)
    monitor_labels = monitoring.get("labels", {}) or {}
    if not isinstance(monitor_labels, dict):
        problems.append(f"spec.monitoring.labels must be an object, got {type(monitor_labels).__name__}")
        monitor_labels = {}
    problems += label_problems(monitor_labels, "spec.monitoring.labels")
    network_policy = bool(object_field(spec, "networkPolicy", problems).get("enabled", True))
    image_d = object_field(spec, "image", problems)
    image = f"{image_d['repository']}:{image_d.get('tag', 'latest')}" if image_d.get("repository") else default_image
    block_size = int_field(spec, "blockSize", DEFAULT_BLOCK_SIZE, "spec", problems, minimum=1)
    if block_size & (block_size - 1) or block_size > 256:
        problems.append(f"spec.blockSize must be a power of two <= 256, got {block_size}")
    kv_cache_dtype = str(object_field(spec, "engine", problems).get("kvCacheDtype", "auto"))
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        problems.append(f"spec.engine.kvCacheDtype must be auto, fp8 or fp8_e4m3, got {kv_cache_dtype!r}")
    engine = object_field(spec, "engine", problems)
    speculative = speculative_flag(engine.get("speculative"), problems)
    loras = parse_loras(spec, model, problems)
    async_scheduling = bool_field(engine, "asyncScheduling", False, "spec.engine", problems)
    expert_parallel = bool_field(engine, "expertParallel", False, "spec.engine", problems)
    if expert_parallel and prefill.tensor_parallel_size == decode.tensor_parallel_size == 1:
        problems.append("spec.engine.expertParallel spreads a MoE model's experts over a role's tensor-parallel "
                        "ranks: set tensorParallelSize > 1 on prefill or decode")
    # the feature pairs the engine refuses, in its words (core/compatibility.py; the CRD's rules are generated)
    problems += compatibility_problems({"prefill": prefill, "decode": decode}, bool(loras.modules), speculative,
                                       async_scheduling, kv_backend, kv_cache_dtype, expert_parallel)
    fp8_activations = str(engine.get("fp8Activations", "auto"))
    if fp8_activations not in ("auto", "on", "off"):
        problems.append(f"spec.engine.fp8Activations must be auto, on or off, got {fp8_activations!r}")
    if problems:
        raise SpecError(problems)
    return InferenceSpec(
        name=name, namespace=namespace, image=image,
        image_pull_policy=str(image_d.get("pullPolicy", "IfNotPresent")), model=model, router=router,
        prefill=prefill, decode=decode, autoscaling=autoscaling, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, speculative=speculative, loras=loras, async_scheduling=async_scheduling,
        expert_parallel=expert_parallel,
        fp8_activations=fp8_activations,
        kv_backend=kv_backend, rdma_device=rdma_device, redis_url=redis_url, redis_url_secret=redis_url_secret,
        tls_issuer=tls_issuer, redis_image=str(redis.get("image", "redis:7.4-alpine")),
        service_monitor=bool(monitoring.get("serviceMonitor", False)),
        pod_monitor=bool(monitoring.get("podMonitor", False)),
        scrape_interval=str(monitoring.get("interval", "15s")),
        monitor_labels=dict(monitor_labels),
        network_policy=network_policy,
        drain_timeout_seconds=drain_timeout,
        prefill_timeout_seconds=prefill_timeout,
        image_pull_secrets=tuple(str(s) for s in spec.get("imagePullSecrets", []) or []))
