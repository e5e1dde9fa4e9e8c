"""The per-role pod settings, the Redis URL from a Secret and the model download, as
rendered from examples/llama-production.yaml (every field set): exact fields in the
router and decode Deployments and the RayCluster's head and workers. That every
manifest of every example validates (kubernetes-validate, KubeRay's CRD) is
test_render.py's test_every_manifest_validates."""

from __future__ import annotations

import yaml

from splitserve.operator.render import Replicas, render_all, unwanted_children
from splitserve.operator.spec import parse_spec
from splitserve.operator.spec_pod import (
    OPERATOR_ENV,
    OPERATOR_LABELS,
    OPERATOR_VOLUMES,
    RESERVED_MOUNT,
)

from .conftest import REPO

EXAMPLE = yaml.safe_load((REPO / "examples/llama-production.yaml").read_text())
SPEC = parse_spec("llama31-8b", "inference", EXAMPLE["spec"], "img:1")
IMAGE = "ghcr.io/splitserve/splitserve:0.1.0"
URI = "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659"
MODEL_DIR = "/models/Llama-3.1-8B-Instruct"
HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
PROXY = [{"configMapRef": {"name": "egress-proxy"}}]
TOKEN_VOLUME = {"name": "cluster-token", "secret": {"secretName": "llama31-8b-cluster-token", "defaultMode": 0o440,
                                                    "items": [{"key": "token", "path": "token"}]}}
TOKEN_MOUNT = {"name": "cluster-token", "mountPath": "/etc/splitserve/cluster-token", "readOnly": True}
TEAM = {"team": "ml-platform", "cost-center": "cc-1234"}
REDIS_FROM_SECRET = {"name": "SPLITSERVE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "redis-url", "key": "url"}}}
OPERATOR_ENV_LIST = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_OFFLINE", "value": "1"}, REDIS_FROM_SECRET]
GPU_AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}]}}}
GPU_TOLERATION = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def rendered() -> dict:
    return {(m["kind"], m["metadata"]["name"]): m for m in render_all(SPEC, Replicas(2, 3), "2.60.0")}


def fetch_model(args_tail: list[str], env: list[dict], mounts: tuple = ()) -> dict:
    return {"name": "fetch-model", "image": IMAGE, "imagePullPolicy": "IfNotPresent", "command": ["splitserve"],
            "args": ["fetch-model", URI, MODEL_DIR, *args_tail],
            "env": [{"name": "HOME", "value": "/tmp"},
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}, *env],
            "envFrom": PROXY, "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
            "securityContext": HARDENED,
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "model", "mountPath": "/models"}, *mounts]}


def spread(role: str, **extra) -> list[dict]:
    return [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "llama31-8b", "splitserve.io/role": role,
                                               **extra}}}]


def test_router_pod_gets_its_settings_and_a_weightless_download():
    template = rendered()[("Deployment", "llama31-8b-router")]["spec"]["template"]
    pod, (router,) = template["spec"], template["spec"]["containers"]
    assert template["metadata"] == {"labels": {**TEAM, "app.kubernetes.io/name": "splitserve",
                                               "app.kubernetes.io/component": "router",
                                               "app.kubernetes.io/managed-by": "splitserve-operator",
                                               "splitserve.io/deployment": "llama31-8b",
                                               "app.kubernetes.io/instance": "llama31-8b", "splitserve.io/role": "router"}}
    api_key_env = {"name": "SPLITSERVE_API_KEY_FILE", "value": "/etc/splitserve/api-key/key"}
    assert router["env"] == OPERATOR_ENV_LIST + [api_key_env]
    assert router["envFrom"] == PROXY
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}, TOKEN_VOLUME, {"name": "model", "emptyDir": {}},
                              {"name": "api-key", "secret": {"secretName": "router-api-key", "defaultMode": 0o440}}]
    assert router["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}, TOKEN_MOUNT,
                                      {"name": "model", "mountPath": "/models", "readOnly": True},
                                      {"name": "api-key", "mountPath": "/etc/splitserve/api-key", "readOnly": True}]
    # The router tokenizes only: config and tokenizer, no weights.
    # The model volume is writable here only; the role's env, envFrom and mounts apply too.
    assert pod["initContainers"] == [fetch_model(["--no-weights"], [api_key_env], router["volumeMounts"][3:])]
    assert pod["topologySpreadConstraints"] == spread("router")
    assert pod["priorityClassName"] == "inference-critical"
    assert "affinity" not in pod and "tolerations" not in pod and "imagePullSecrets" not in pod


def test_decode_pod_gets_its_settings_and_the_full_download():
    template = rendered()[("Deployment", "llama31-8b-decode")]["spec"]["template"]
    pod, (decode,) = template["spec"], template["spec"]["containers"]
    assert template["metadata"]["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    cuda_env = {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"}
    assert decode["env"] == OPERATOR_ENV_LIST + [cuda_env]
    assert pod["initContainers"] == [fetch_model([], [cuda_env])]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}, TOKEN_VOLUME, {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                              {"name": "model", "emptyDir": {}}]
    assert pod["affinity"] == EXAMPLE["spec"]["decode"]["affinity"]
    assert pod["affinity"]["nodeAffinity"] == GPU_AFFINITY["nodeAffinity"]
    assert pod["tolerations"] == GPU_TOLERATION
    assert pod["topologySpreadConstraints"] == spread("decode")  # no labelSelector given: this role's pods
    assert pod["priorityClassName"] == "inference-critical"
    assert decode["args"][decode["args"].index("--model") + 1] == MODEL_DIR


def test_ray_head_gets_settings_but_not_placement_workers_get_both():
    ray = rendered()[("RayCluster", "llama31-8b-prefill")]["spec"]
    head = ray["headGroupSpec"]["template"]
    (group,) = ray["workerGroupSpecs"]
    worker = group["template"]
    for t, node in ((head, "head"), (worker, "worker")):
        assert t["metadata"]["labels"]["splitserve.io/ray-node"] == node and t["metadata"]["labels"]["team"] == "ml-platform"
        assert t["spec"]["containers"][0]["envFrom"] == PROXY
        assert t["spec"]["containers"][0]["env"] == OPERATOR_ENV_LIST
        assert t["spec"]["priorityClassName"] == "inference-critical"
    # The head holds no GPU and loads no weights.
    assert head["spec"]["initContainers"] == [fetch_model(["--no-weights"], [])]
    assert not {"affinity", "tolerations", "topologySpreadConstraints", "nodeSelector"} & set(head["spec"])
    assert worker["spec"]["initContainers"] == [fetch_model([], [])]
    assert worker["spec"]["affinity"] == GPU_AFFINITY and worker["spec"]["tolerations"] == GPU_TOLERATION


def pod_templates(manifests) -> list[dict]:
    """Every pod template of the role workloads (the in-cluster Redis has no role settings)."""
    out = []
    for m in manifests:
        if m["kind"] == "Deployment" and not m["metadata"]["name"].endswith("-redis"):
            out.append(m["spec"]["template"])
        elif m["kind"] == "RayCluster":
            out += [m["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in m["spec"]["workerGroupSpecs"]]
    return out


def test_redis_url_from_a_secret_is_never_in_plain_text():
    manifests = rendered()
    assert not [k for k in manifests if k[1] == "llama31-8b-redis"]  # external: nothing deployed, no policy
    assert ("apps/v1", "Deployment", "llama31-8b-redis") in unwanted_children(SPEC, "2.60.0")
    containers = [c for t in pod_templates(manifests.values()) for c in t["spec"]["containers"]]
    assert len(containers) == 4
    for c in containers:
        assert REDIS_FROM_SECRET in c["env"]
    assert "rediss://" not in yaml.safe_dump(list(manifests.values()))


def test_image_pull_secrets_of_the_deployment_and_the_role_are_merged(minimal_spec):
    spec = parse_spec("q", "ns", {**minimal_spec, "imagePullSecrets": ["shared", "gpu-registry"],
                                  "decode": {"imagePullSecrets": ["gpu-registry", "decode-only"]}}, "img:1")
    pull = {m["metadata"]["name"]: [s["name"] for s in m["spec"]["template"]["spec"]["imagePullSecrets"]]
            for m in render_all(spec, Replicas(1, 1), "2.60.0") if m["kind"] == "Deployment"}
    assert pull == {"q-decode": ["shared", "gpu-registry", "decode-only"], "q-router": ["shared", "gpu-registry"],
                    "q-redis": ["shared", "gpu-registry"]}


def test_what_the_operator_sets_is_exactly_what_the_crd_reserves(minimal_spec):
    """The operator's own env names, volumes, mount paths and label keys, in every pod
    it renders (every example and a uri source with a token), are the reserved ones."""
    source = {"type": "uri", "uri": "hf://org/name", "tokenSecretRef": {"name": "hf", "key": "t"}}
    specs = [parse_spec("q", "ns", {**minimal_spec, "model": {**minimal_spec["model"], "source": source},
                                    "tls": {"certManager": {"issuerRef": {"name": "cluster-ca"}}}}, "i")]
    for path in sorted((REPO / "examples").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        specs.append(parse_spec(obj["metadata"]["name"], "ns", obj["spec"], "img:1"))
    env, volumes, labels = set(), set(), set()
    for spec in specs:
        roles = [spec.router.pod, spec.prefill.pod, spec.decode.pod]
        for t in pod_templates(render_all(spec, Replicas(1, 1), "2.60.0")):
            labels |= set(t["metadata"]["labels"]) - {k for r in roles for k in r.labels}
            volumes |= {v["name"] for v in t["spec"]["volumes"]} - {v["name"] for r in roles for v in r.volumes}
            for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
                env |= {e["name"] for e in c["env"]} - {e["name"] for r in roles for e in r.env}
                assert all(RESERVED_MOUNT.match(x["mountPath"]) for x in c["volumeMounts"]
                           if x["name"] in OPERATOR_VOLUMES)
    assert env == set(OPERATOR_ENV)
    assert volumes == set(OPERATOR_VOLUMES)
    assert labels - set(OPERATOR_LABELS) == {"splitserve.io/deployment", "splitserve.io/role", "splitserve.io/ray-node"}
