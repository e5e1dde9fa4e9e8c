"""The prefill pool as a KubeRay RayCluster: the head runs `splitserve prefill-pool`
(the Ray driver keeping prefill actors alive), one worker group hosts the actors.

KubeRay normally owns the container command; the `ray.io/overwrite-container-cmd`
annotation hands it to us, and KubeRay puts its generated `ray start` command in
$KUBERAY_GEN_RAY_START_CMD. The head starts Ray without `--block`, then execs the
pool so the pool's exit ends the pod (and KubeRay restarts it).
"""

from __future__ import annotations

from splitserve.core.ports import PREFILL_ADMIN_PORT

from . import render_common as c
from .render_pod import pod_template
from .render_workloads import kv_args
from .spec import InferenceSpec
from .spec_kv_offload import kv_offload_mounts, kv_offload_volumes

PREFILL_GROUP = "prefill"
WORKER_METRICS_PORT = PREFILL_ADMIN_PORT  # each prefill actor's /metrics, on the Ray worker pods


def _container(spec: InferenceSpec, name: str, resources: dict) -> dict:
    return {
        "name": name, "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "env": c.env(spec), "resources": resources, "securityContext": c.container_security_context(),
        "volumeMounts": c.volume_mounts(spec, shm=True),
    }


def _pod_template(spec: InferenceSpec, node: str, container: dict) -> dict:
    # The head runs the driver and the GCS: no GPU, no weights, no placement of the workers.
    head = node == "head"
    return pod_template(spec, "prefill", spec.prefill.pod, [container], shm=True, placement=not head,
                        weights=not head, node_labels={"splitserve.io/ray-node": node})


def head_command(spec: InferenceSpec) -> str:
    # `--replicas` is the spec's starting size, not the autoscaler's current one: the
    # head's pod template must not change on every scaling step. The autoscaler moves
    # the worker group's replicas; the pool keeps one prefill actor per worker pod.
    pool = ["splitserve", "prefill-pool", "--model", c.model_dir(spec), "--replicas", str(spec.prefill.replicas),
            "--one-per-worker-node", *c.common_args(spec), *kv_args(spec),
            *(["--kv-protocol", "rdma"] if spec.rdma_device else []), "--port", str(c.PREFILL_GRPC_PORT),
            "--metrics-port", str(c.ADMIN_PORT), "--worker-metrics-port", str(WORKER_METRICS_PORT),
            "--gpus-per-worker", str(spec.prefill.gpus), *c.engine_args(spec, spec.prefill)]
    # `$(SPLITSERVE_REDIS_URL)` is Kubernetes' env expansion for args; inside a shell
    # string it must become a shell variable instead.
    pool_cmd = " ".join(pool).replace("$(SPLITSERVE_REDIS_URL)", '"$SPLITSERVE_REDIS_URL"')
    return ("ulimit -n 65536 || true; "
            'eval "${KUBERAY_GEN_RAY_START_CMD//--block/}" && '
            f"exec {pool_cmd}")


def render_prefill(spec: InferenceSpec, replicas: int, ray_version: str) -> list[dict]:
    p = spec.prefill
    head = _container(spec, "ray-head", {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}})
    head["command"] = ["/bin/bash", "-c", "--"]
    head["args"] = [head_command(spec)]
    # KubeRay's own port names (gcs-server, dashboard, client; "metrics" is Ray's 8080),
    # plus the pool's metrics under a name of ours.
    head["ports"] = [{"name": "gcs-server", "containerPort": 6379, "protocol": "TCP"},
                     {"name": "dashboard", "containerPort": 8265, "protocol": "TCP"},
                     {"name": "client", "containerPort": 10001, "protocol": "TCP"},
                     {"name": "pool-metrics", "containerPort": c.ADMIN_PORT, "protocol": "TCP"}]
    worker = _container(spec, "ray-worker", p.resources)
    worker["command"] = ["/bin/bash", "-c", "--"]
    worker["args"] = ['ulimit -n 65536 || true; exec $KUBERAY_GEN_RAY_START_CMD']
    worker["ports"] = [{"name": "grpc", "containerPort": c.PREFILL_GRPC_PORT, "protocol": "TCP"},
                       {"name": "actor-metrics", "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"}]
    worker["volumeMounts"] += kv_offload_mounts(p.kv_offload)  # the prefill actors' disk KV tier
    worker_template = _pod_template(spec, "worker", worker)
    worker_template["spec"]["volumes"] += kv_offload_volumes(p.kv_offload)
    metadata = c.metadata(spec, "prefill")
    metadata["annotations"] = {"ray.io/overwrite-container-cmd": "true"}
    return [{
        "apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": metadata,
        "spec": {
            "rayVersion": ray_version,
            # splitserve's autoscaler sets the worker replicas; Ray's own must stay off.
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                # No prefill actor on the head: it only runs the driver and the GCS.
                "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
                "template": _pod_template(spec, "head", head),
            },
            "workerGroupSpecs": [{
                "groupName": PREFILL_GROUP, "replicas": replicas,
                "minReplicas": p.min_replicas, "maxReplicas": p.max_replicas,
                "rayStartParams": {},
                "template": worker_template,
            }],
        },
    }]
