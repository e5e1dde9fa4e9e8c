"""Router Deployment + Service, decode Deployment, optional in-cluster Redis.

Commands and ports here are the component contracts (`splitserve router`,
`splitserve decode-worker`); change them only together with the components.
"""

from __future__ import annotations

from . import render_common as c
from .render_pod import pod_template
from .spec import InferenceSpec
from .spec_kv_offload import kv_offload_mounts, kv_offload_volumes


def _probe(path: str, port: int, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def _deployment(spec: InferenceSpec, role: str, replicas: int, template: dict,
                max_surge: int | str = 1) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": c.metadata(spec, role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": c.selector_labels(spec, role)},
            # Never take a serving replica away before its replacement is ready.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": max_surge, "maxUnavailable": 0}},
            "template": template,
        },
    }


def render_router(spec: InferenceSpec) -> list[dict]:
    # The router only tokenizes: it reads tokenizer, chat template and context length
    # from --model, so a separate tokenizer directory takes that place. Block hashes
    # are seeded by the served name, not the path, so they still match the workers'.
    args = ["router", "--host", "0.0.0.0", "--port", str(c.ROUTER_PORT),
            "--model", c.tokenizer_dir(spec) or c.model_dir(spec),
            "--served-model-name", spec.model.served_name, *c.common_args(spec),
            "--block-size", str(spec.block_size)]
    if spec.router.stream_interval != 1:  # 1 is the router's own default
        args += ["--stream-interval", str(spec.router.stream_interval)]
    if spec.router.strict_disaggregation:
        args.append("--strict-disaggregation")
    if spec.model.max_model_len:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.decode.min_replicas == 0:  # scale to zero: hold requests while no decode worker runs
        a = spec.autoscaling
        args += ["--hold-requests-at-zero", str(a.hold_requests_at_zero), "--hold-timeout",
                 str(a.hold_timeout_seconds)]
    container = {
        "name": "router", "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["splitserve"], "args": args, "env": c.env(spec),
        "ports": [{"name": "http", "containerPort": c.ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": _probe("/health", c.ROUTER_PORT, 5, 3),
        # /health is 503 while no decode worker is registered (200 while holding requests at
        # zero, so the Service keeps the router): restarting routers would not help.
        "livenessProbe": _probe("/livez", c.ROUTER_PORT, 10, 6),
        "resources": spec.router.resources, "securityContext": c.container_security_context(),
        "volumeMounts": c.volume_mounts(spec, shm=False),
    }
    # The router reads config and tokenizer only: a downloaded model comes without weights.
    pod = pod_template(spec, "router", spec.router.pod, [container], shm=False, weights=False)
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": c.metadata(spec, "router"),
        "spec": {"type": spec.router.service_type, "selector": c.selector_labels(spec, "router"),
                 "ports": [{"name": "http", "port": c.ROUTER_PORT, "targetPort": "http", "protocol": "TCP"}]},
    }
    return [_deployment(spec, "router", spec.router.replicas, pod), service]


def kv_args(spec: InferenceSpec) -> list[str]:
    args = ["--kv-backend", spec.kv_backend]
    if spec.rdma_device:
        args += ["--rdma-device", spec.rdma_device]
    return args


def render_decode(spec: InferenceSpec, replicas: int) -> list[dict]:
    d = spec.decode
    args = ["decode-worker", "--model", c.model_dir(spec), "--host", "0.0.0.0", "--port", str(c.DECODE_GRPC_PORT),
            "--admin-port", str(c.ADMIN_PORT), *c.common_args(spec), *kv_args(spec),
            *(["--kv-protocol", "rdma"] if spec.rdma_device else []),
            "--drain-timeout", str(spec.drain_timeout_seconds), *c.engine_args(spec, d)]
    if spec.prefill_timeout_seconds != 30.0:  # the decode worker's own default
        args += ["--prefill-timeout", f"{spec.prefill_timeout_seconds:g}"]
    container = {
        "name": "decode", "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["splitserve"], "args": args, "env": c.env(spec),
        "ports": [{"name": "grpc", "containerPort": c.DECODE_GRPC_PORT, "protocol": "TCP"},
                  {"name": "admin", "containerPort": c.ADMIN_PORT, "protocol": "TCP"}],
        # Loading weights can take minutes; liveness starts only after the first success.
        "startupProbe": _probe("/health", c.ADMIN_PORT, 10, 90),
        "readinessProbe": _probe("/health", c.ADMIN_PORT, 5, 2),
        # /livez, not /health: 503 only when the engine thread is dead or stalled or the gRPC
        # server does not answer (a zombie that must be restarted); a draining worker is alive.
        "livenessProbe": _probe("/livez", c.ADMIN_PORT, 15, 4),
        # Scale-down drains: /drain stops admission and returns once no stream is left
        # (finished or handed off); the grace period bounds how long that may take. It
        # listens on loopback only, so the hook execs `splitserve drain` inside the pod
        # (an httpGet hook comes from the node, and anything that may scrape must not drain).
        "lifecycle": {"preStop": {"exec": {"command": [
            "splitserve", "drain", "--port", str(c.DRAIN_PORT),
            "--timeout", str(spec.drain_timeout_seconds + 30)]}}},
        "resources": d.resources, "securityContext": c.container_security_context(),
        "volumeMounts": c.volume_mounts(spec, shm=True) + kv_offload_mounts(d.kv_offload),
    }
    pod = pod_template(spec, "decode", d.pod, [container], shm=True)
    pod["spec"]["volumes"] += kv_offload_volumes(d.kv_offload)  # the disk KV tier's, when it has one
    pod["spec"]["terminationGracePeriodSeconds"] = spec.drain_timeout_seconds + 30
    # maxSurge 0 for GPU pods: a surge pod would wait for a GPU the old pod holds.
    deployment = _deployment(spec, "decode", replicas, pod, max_surge=0)
    deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] = 1
    return [deployment]


def render_redis(spec: InferenceSpec) -> list[dict]:
    """A single-replica, memory-only Redis for the cluster bus. Load reports and
    registrations are refreshed by heartbeats and KV event streams are rebuilt by
    workers after a restart, so no persistence is needed; use spec.redis.url for HA."""
    container = {
        "name": "redis", "image": spec.redis_image, "imagePullPolicy": "IfNotPresent",
        "command": ["redis-server"], "args": ["--save", "", "--appendonly", "no", "--port", str(c.REDIS_PORT)],
        "ports": [{"name": "redis", "containerPort": c.REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": c.REDIS_PORT}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": c.REDIS_PORT}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": c.container_security_context(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = {"metadata": {"labels": c.labels(spec, "redis")},
           "spec": {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}],
                    **c.pod_spec_extras(spec)}}
    deployment = _deployment(spec, "redis", 1, pod, max_surge=0)
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": c.metadata(spec, "redis"),
        "spec": {"selector": c.selector_labels(spec, "redis"),
                 "ports": [{"name": "redis", "port": c.REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]},
    }
    return [deployment, service]
