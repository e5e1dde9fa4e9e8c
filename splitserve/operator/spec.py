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
from splitserve.core.model_uri import parse_model_uri

from .spec_pod import PodSettings, parse_pod_settings

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
class SecretRef:
    """One key of a Secret in the InferenceDeployment's namespace."""
    name: str
    key: str


@dataclass(frozen=True)
class ModelSpec:
    served_name: str
    source_type: str  # pvc | hostPath | image | uri
    path: str  # relative to the volume root (pvc, hostPath, uri) or absolute inside the image
    claim_name: str = ""
    host_path: str = ""
    uri: str = ""  # source.type uri: hf://ORG/NAME[@REVISION], downloaded by an init container
    token_secret: SecretRef | None = None  # source.type uri: HF_TOKEN of the download
    tokenizer: str = ""  # same convention as `path`; empty = the model directory
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # None: the checkpoint's own context length


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
    kv_backend: str = "grpc"
    rdma_device: str = ""
    redis_url: str = ""  # empty and no redis_url_secret: the operator deploys an in-cluster Redis
    redis_url_secret: SecretRef | None = None  # the external Redis URL, from a Secret
    redis_image: str = "redis:7.4-alpine"
    service_monitor: bool = False
    pod_monitor: bool = False
    scrape_interval: str = "15s"
    network_policy: bool = True
    drain_timeout_seconds: int = 600
    image_pull_secrets: tuple[str, ...] = ()

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


def _int(d: dict, key: str, default: int, where: str, problems: list[str], minimum: int = 0) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{where}.{key} must be an integer, got {value!r}")
        return default
    if value < minimum:
        problems.append(f"{where}.{key} must be >= {minimum}, got {value}")
    return value


def _float(d: dict, key: str, default: float, where: str, problems: list[str]) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.append(f"{where}.{key} must be a number, got {value!r}")
        return default
    return float(value)


def _section(spec: dict, key: str, problems: list[str]) -> dict:
    value = spec.get(key, {})
    if not isinstance(value, dict):
        problems.append(f"spec.{key} must be an object, got {type(value).__name__}")
        return {}
    return value


def _role(d: dict, where: str, problems: list[str], replicas: int, maximum: int) -> RoleSpec:
    role = RoleSpec(
        replicas=_int(d, "replicas", replicas, where, problems, minimum=1),
        min_replicas=_int(d, "minReplicas", 1, where, problems, minimum=1),
        max_replicas=_int(d, "maxReplicas", maximum, where, problems, minimum=1),
        resources=d.get("resources", {}) or {},
        max_num_batched_tokens=_int(d, "maxNumBatchedTokens", 8192, where, problems, minimum=1),
        max_num_seqs=_int(d, "maxNumSeqs", 256, where, problems, minimum=1),
        pod=parse_pod_settings(d, where, problems),
        kv_cache_memory_gib=_float(d, "kvCacheMemoryGiB", 0.0, where, problems) or None,
    )
    if role.kv_cache_memory_gib is not None and role.kv_cache_memory_gib <= 0:
        problems.append(f"{where}.kvCacheMemoryGiB must be > 0")
    try:
        role.gpus  # noqa: B018 - validates the quantity
    except (TypeError, ValueError):
        problems.append(f"{where}.resources nvidia.com/gpu must be a whole number")
    # The CRD's CEL rules, repeated (see module docstring).
    if role.min_replicas > role.max_replicas:
        problems.append(f"{where}.minReplicas ({role.min_replicas}) must be <= "
                        f"{where}.maxReplicas ({role.max_replicas})")
    elif not role.min_replicas <= role.replicas <= role.max_replicas:
        problems.append(f"{where}.replicas ({role.replicas}) must lie within "
                        f"[minReplicas, maxReplicas] = [{role.min_replicas}, {role.max_replicas}]")
    return role


def _secret_ref(d: dict, key: str, where: str, problems: list[str]) -> SecretRef | None:
    ref = d.get(key)
    if ref is None:
        return None
    if not isinstance(ref, dict) or not ref.get("name") or not ref.get("key"):
        problems.append(f"{where}.{key} needs name and key (a key of a Secret in this namespace)")
        return None
    return SecretRef(str(ref["name"]), str(ref["key"]))


def _model(d: dict, problems: list[str]) -> ModelSpec:
    source = d.get("source", {}) or {}
    model = ModelSpec(
        served_name=str(d.get("servedName", "")), source_type=str(source.get("type", "pvc")),
        path=str(d.get("path", "")), claim_name=str(source.get("claimName", "")),
        host_path=str(source.get("hostPath", "")), uri=str(source.get("uri", "")),
        token_secret=_secret_ref(source, "tokenSecretRef", "spec.model.source", problems),
        tokenizer=str(d.get("tokenizer", "")), dtype=str(d.get("dtype", "bfloat16")),
        max_model_len=_int(d, "maxModelLen", 0, "spec.model", problems) or None)
    if model.dtype not in ("bfloat16", "float16", "float32"):
        problems.append(f"spec.model.dtype must be bfloat16, float16 or float32, got {model.dtype!r}")
    if not model.served_name:
        problems.append("spec.model.servedName is required (the name clients pass as `model`)")
    if model.source_type not in ("pvc", "hostPath", "image", "uri"):
        problems.append(f"spec.model.source.type must be pvc, hostPath, image or uri, got {model.source_type!r}")
    if model.source_type == "uri":
        try:
            parse_model_uri(model.uri)
        except ValueError as exc:
            problems.append(f"spec.model.{exc}")
        if model.tokenizer and model.tokenizer.rstrip("/") != model.path.rstrip("/") \
                and not model.tokenizer.startswith(model.path.rstrip("/") + "/"):
            problems.append("spec.model.tokenizer must lie inside model.path when source.type is uri "
                            "(only that snapshot is downloaded)")
    elif "uri" in source or "tokenSecretRef" in source:
        problems.append("spec.model.source.uri and source.tokenSecretRef are only used by source.type uri")
    if model.source_type == "pvc" and not model.claim_name:
        problems.append("spec.model.source.claimName is required when source.type is pvc")
    if model.source_type == "hostPath" and not model.host_path.startswith("/"):
        problems.append("spec.model.source.hostPath must be an absolute node path when source.type is hostPath")
    for key, value in (("path", model.path), ("tokenizer", model.tokenizer)):
        if key == "path" and not value:
            problems.append("spec.model.path is required (the model directory)")
        elif value and model.source_type == "image" and not value.startswith("/"):
            problems.append(f"spec.model.{key} must be absolute when source.type is image, got {value!r}")
        elif value and model.source_type != "image" and (value.startswith("/") or ".." in value):
            problems.append(f"spec.model.{key} must be relative to the volume root without '..', got {value!r}")
    return model


def parse_spec(name: str, namespace: str, spec: dict[str, Any], default_image: str) -> InferenceSpec:
    """Spec dict (as stored, defaults possibly missing) -> InferenceSpec, or SpecError."""
    problems: list[str] = []
    if not isinstance(spec, dict):
        raise SpecError([f"spec must be an object, got {type(spec).__name__}"])
    if len(name) > MAX_NAME_LENGTH:
        problems.append(f"metadata.name must be at most {MAX_NAME_LENGTH} characters (child names append suffixes)")
    model = _model(_section(spec, "model", problems), problems)
    router_d = _section(spec, "router", problems)
    router = RouterSpec(replicas=_int(router_d, "replicas", 2, "spec.router", problems, minimum=1),
                        resources=router_d.get("resources", {}) or {},
                        service_type=str(router_d.get("serviceType", "ClusterIP")),
                        pod=parse_pod_settings(router_d, "spec.router", problems))
    if router.service_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        problems.append(f"spec.router.serviceType must be ClusterIP, NodePort or LoadBalancer, got {router.service_type!r}")
    prefill = _role(_section(spec, "prefill", problems), "spec.prefill", problems, 1, 4)
    decode_d = _section(spec, "decode", problems)
    decode = _role(decode_d, "spec.decode", problems, 1, 4)
    drain_timeout = _int(decode_d, "drainTimeoutSeconds", 600, "spec.decode", problems, minimum=1)
    if decode.max_num_batched_tokens < decode.max_num_seqs:
        problems.append(f"spec.decode.maxNumBatchedTokens ({decode.max_num_batched_tokens}) must be >= "
                        f"spec.decode.maxNumSeqs ({decode.max_num_seqs})")
    a = _section(spec, "autoscaling", problems)
    autoscaling = AutoscalingSpec(
        enabled=bool(a.get("enabled", True)),
        target_waiting_per_replica=_float(a, "targetWaitingPerReplica", 4.0, "spec.autoscaling", problems),
        low_watermark=_float(a, "lowWatermark", 0.5, "spec.autoscaling", problems),
        scale_up_window_seconds=_int(a, "scaleUpWindowSeconds", 60, "spec.autoscaling", problems),
        scale_down_window_seconds=_int(a, "scaleDownWindowSeconds", 300, "spec.autoscaling", problems),
        max_step=_int(a, "maxStep", 2, "spec.autoscaling", problems, minimum=1),
        stale_after_seconds=_int(a, "staleAfterSeconds", 30, "spec.autoscaling", problems, minimum=1))
    if autoscaling.target_waiting_per_replica <= 0:
        problems.append("spec.autoscaling.targetWaitingPerReplica must be > 0")
    if not 0 < autoscaling.low_watermark < 1:
        problems.append("spec.autoscaling.lowWatermark must lie strictly between 0 and 1")
    kv = _section(spec, "kvTransfer", problems)
    kv_backend, rdma_device = str(kv.get("backend", "grpc")), str(kv.get("rdmaDevice", ""))
    if kv_backend not in ("grpc", "mooncake"):
        problems.append(f"spec.kvTransfer.backend must be grpc or mooncake, got {kv_backend!r}")
    if rdma_device and kv_backend != "mooncake":
        problems.append("spec.kvTransfer.rdmaDevice is only used by the mooncake backend; set backend: mooncake")
    redis = _section(spec, "redis", problems)
    redis_url = str(redis.get("url", ""))
    redis_url_secret = _secret_ref(redis, "urlSecretRef", "spec.redis", problems)
    if redis_url and not redis_url.startswith(("redis://", "rediss://")):
        problems.append(f"spec.redis.url must start with redis:// or rediss://, got {redis_url!r}")
    if redis_url and redis_url_secret:
        problems.append("spec.redis.url and redis.urlSecretRef are mutually exclusive: keep the URL in the "
                        "Secret and leave url unset")
    monitoring = _section(spec, "monitoring", problems)
    network_policy = bool(_section(spec, "networkPolicy", problems).get("enabled", True))
    image_d = _section(spec, "image", problems)
    image = f"{image_d['repository']}:{image_d.get('tag', 'latest')}" if image_d.get("repository") else default_image
    block_size = _int(spec, "blockSize", DEFAULT_BLOCK_SIZE, "spec", problems, minimum=1)
    if block_size & (block_size - 1) or block_size > 256:
        problems.append(f"spec.blockSize must be a power of two <= 256, got {block_size}")
    if problems:
        raise SpecError(problems)
    return InferenceSpec(
        name=name, namespace=namespace, image=image,
        image_pull_policy=str(image_d.get("pullPolicy", "IfNotPresent")), model=model, router=router,
        prefill=prefill, decode=decode, autoscaling=autoscaling, block_size=block_size,
        kv_backend=kv_backend, rdma_device=rdma_device, redis_url=redis_url, redis_url_secret=redis_url_secret,
        redis_image=str(redis.get("image", "redis:7.4-alpine")),
        service_monitor=bool(monitoring.get("serviceMonitor", False)),
        pod_monitor=bool(monitoring.get("podMonitor", False)),
        scrape_interval=str(monitoring.get("interval", "15s")),
        network_policy=network_policy,
        drain_timeout_seconds=drain_timeout,
        image_pull_secrets=tuple(str(s) for s in spec.get("imagePullSecrets", []) or []))
