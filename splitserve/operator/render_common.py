"""Pieces every rendered child shares: names, labels, owner reference, pod hardening,
the model volume. Pure functions of the parsed spec. A role's pod template is put
together in render_pod.py."""

from __future__ import annotations

# The ports the worker CLIs listen on by default (one definition, core/ports.py).
from splitserve.core.ports import (  # noqa: F401 - the renderers use them as c.<NAME>
    ADMIN_PORT,
    DECODE_GRPC_PORT,
    DRAIN_PORT,
    PREFILL_GRPC_PORT,
    REDIS_PORT,
    ROUTER_PORT,
)

from . import cert_manager as tls
from .spec import InferenceSpec, RoleSpec
from .spec_kv_offload import kv_offload_args

MODEL_MOUNT = "/models"
RUN_AS_USER = 1000
# The cluster token Secret (cluster_token.py), mounted into every pod of the deployment.
TOKEN_KEY = "token"
TOKEN_DIR = "/etc/splitserve/cluster-token"
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"
TOKEN_VOLUME = "cluster-token"
TOKEN_HASH_ANNOTATION = "splitserve.io/cluster-token-hash"


def child_name(spec: InferenceSpec, role: str) -> str:
    return f"{spec.name}-{role}"


def selector_labels(spec: InferenceSpec, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": spec.name, "splitserve.io/role": role}


def labels(spec: InferenceSpec, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "splitserve",
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/managed-by": "splitserve-operator",
        "splitserve.io/deployment": spec.name,
        **selector_labels(spec, role),
    }


def metadata(spec: InferenceSpec, role: str, name: str | None = None) -> dict:
    """Object metadata; the owner reference is added by `adopt` at apply time."""
    return {"name": name or child_name(spec, role), "namespace": spec.namespace,
            "labels": labels(spec, role)}


def adopt(manifest: dict, owner: dict) -> dict:
    """The owner reference that makes Kubernetes garbage-collect children with the
    InferenceDeployment (controller=True: `kubectl describe` names it as the owner)."""
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    out = dict(manifest)
    out["metadata"] = {**manifest["metadata"], "ownerReferences": [ref]}
    return out


def pod_security_context() -> dict:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def model_dir(spec: InferenceSpec) -> str:
    m = spec.model
    return m.path if m.source_type == "image" else f"{MODEL_MOUNT}/{m.path.strip('/')}"


def tokenizer_dir(spec: InferenceSpec) -> str:
    m = spec.model
    if not m.tokenizer:
        return ""
    return m.tokenizer if m.source_type == "image" else f"{MODEL_MOUNT}/{m.tokenizer.strip('/')}"


def volumes(spec: InferenceSpec, shm: bool) -> list[dict]:
    """/tmp is writable scratch (the root filesystem is read-only); workers get a
    memory-backed /dev/shm for torch and Ray; the model volume is mounted read-only."""
    vols: list[dict] = [{"name": "tmp", "emptyDir": {}},
                        {"name": TOKEN_VOLUME, "secret": {"secretName": spec.cluster_token_secret, "defaultMode": 0o440,
                                                          "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]}}]
    if shm:
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if spec.tls_issuer is not None:
        vols.append(tls.tls_volume(spec.name))
    m = spec.model
    if m.source_type == "pvc":
        vols.append({"name": "model", "persistentVolumeClaim": {"claimName": m.claim_name, "readOnly": True}})
    elif m.source_type == "hostPath":
        vols.append({"name": "model", "hostPath": {"path": m.host_path, "type": "Directory"}})
    elif m.source_type == "uri":  # filled by the pod's fetch-model init container (render_pod.py)
        vols.append({"name": "model", "emptyDir": {}})
    return vols


def volume_mounts(spec: InferenceSpec, shm: bool) -> list[dict]:
    mounts: list[dict] = [{"name": "tmp", "mountPath": "/tmp"},
                          {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    if spec.tls_issuer is not None:
        mounts.append(tls.tls_mount())
    if shm:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.model.source_type != "image":
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    return mounts


def env(spec: InferenceSpec) -> list[dict]:
    """Pod identity (workers register POD_IP on the bus) and offline model loading: the
    model is on the volume (put there by an init container for source.type uri). The
    Redis URL comes from the Secret when the spec names one, so it never sits in a
    pod spec in plain text. spec_pod.OPERATOR_ENV lists these names."""
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    secret = spec.redis_url_secret
    redis = ({"valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}} if secret
             else {"value": spec.effective_redis_url})
    return [
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "POD_IP", **field("status.podIP")},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "SPLITSERVE_REDIS_URL", **redis},
    ]


def pod_spec_extras(spec: InferenceSpec) -> dict:
    """Hardening and the deployment-wide image pull secrets, for every pod."""
    extras: dict = {"securityContext": pod_security_context(), "automountServiceAccountToken": False}
    if spec.image_pull_secrets:
        extras["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    return extras


def common_args(spec: InferenceSpec) -> list[str]:
    """Flags every component takes; the Redis URL goes through the env var so a
    later change to secret-sourced URLs touches one place."""
    args = ["--redis-url", "$(SPLITSERVE_REDIS_URL)", "--cluster", spec.cluster, "--cluster-token-file", TOKEN_FILE]
    return args + (tls.tls_args(spec.name, spec.namespace) if spec.tls_issuer is not None else [])


def engine_args(spec: InferenceSpec, role: RoleSpec) -> list[str]:
    """Flags every engine (decode worker, prefill pool) takes. The served name seeds
    the block-hash space: router and workers must pass the same one."""
    m = spec.model
    args = ["--served-model-name", m.served_name, "--block-size", str(spec.block_size),
            "--device", "cuda" if role.gpus else "cpu", "--dtype", m.dtype,
            "--max-num-seqs", str(role.max_num_seqs), "--max-num-batched-tokens", str(role.max_num_batched_tokens)]
    if m.max_model_len:
        args += ["--max-model-len", str(m.max_model_len)]
    if role.kv_cache_memory_gib:
        args += ["--kv-cache-memory", f"{role.kv_cache_memory_gib:g}"]
    if role.tensor_parallel_size > 1:  # the worker's engine starts its rank processes in the same pod
        args += ["--tensor-parallel-size", str(role.tensor_parallel_size)]
        if spec.expert_parallel:  # experts spread over those ranks (a role of one rank has all of them)
            args += ["--enable-expert-parallel"]
    args += kv_offload_args(role.kv_offload)  # its disk tier's volume: the role's pods mount it (kv_offload_mounts)
    if spec.kv_cache_dtype != "auto":  # prefill and decode workers must agree: one field for both
        args += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if spec.speculative and role is spec.decode:  # drafts are verified where tokens are decoded
        args += ["--speculative-config", spec.speculative]
    if spec.async_scheduling and role is spec.decode:  # prefill workers make one token: nothing to overlap
        args += ["--async-scheduling"]
    if spec.fp8_activations != "auto":
        args += ["--fp8-activations", spec.fp8_activations]
    return args + spec.loras.flags()  # both roles: a remote prefill applies the request's adapter too
