"""The pure renderers: every manifest the operator produces validates (core kinds with
kubernetes-validate, RayCluster/ServiceMonitor/PodMonitor against the real CRDs in
../shared/schemas), follows the component contracts, and is hardened."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from splitserve.operator.apply import drifted
from splitserve.operator.render import Replicas, render_all, unwanted_children
from splitserve.operator.render_common import adopt
from splitserve.operator.spec import SpecError, parse_spec
from splitserve.operator.status import conditions, observe_deployment, observe_raycluster

from .conftest import REPO, third_party_validator

K8S_VERSION = kubernetes_validate.latest_version()
CUSTOM = {"RayCluster": "ray.io_rayclusters.yaml", "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
          "PodMonitor": "monitoring.coreos.com_podmonitors.yaml"}
OWNER = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
         "metadata": {"name": "llama3-8b", "namespace": "inference", "uid": "0f6c2a6e-1111-2222-3333-444455556666"}}


def example_specs():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        yield path.name, parse_spec(obj["metadata"]["name"], obj["metadata"]["namespace"], obj["spec"], "img:1")


SPECS = dict(example_specs())


def render(spec, prefill=2, decode=3):
    return [adopt(m, OWNER) for m in render_all(spec, Replicas(prefill, decode), "2.60.0")]


def by_kind_name(manifests):
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


@pytest.mark.parametrize("name", SPECS)
def test_every_manifest_validates(name):
    kinds = set()
    for m in render(SPECS[name]):
        kinds.add(m["kind"])
        if m["kind"] in CUSTOM:
            third_party_validator(CUSTOM[m["kind"]])(m)
        else:
            kubernetes_validate.validate(m, K8S_VERSION, strict=True)
    assert {"Deployment", "Service", "RayCluster", "PodDisruptionBudget", "NetworkPolicy"} <= kinds


def test_monitors_render_when_enabled_and_validate():
    manifests = by_kind_name(render(SPECS["llama-pvc.yaml"]))
    assert ("ServiceMonitor", "llama3-8b-router") in manifests
    assert ("PodMonitor", "llama3-8b-decode") in manifests and ("PodMonitor", "llama3-8b-prefill") in manifests
    head_monitor = manifests[("PodMonitor", "llama3-8b-prefill")]
    assert "splitserve.io/ray-node" not in head_monitor["spec"]["selector"]["matchLabels"]
    assert [e["port"] for e in head_monitor["spec"]["podMetricsEndpoints"]] == ["pool-metrics", "actor-metrics"]
    ray = manifests[("RayCluster", "llama3-8b-prefill")]
    head_ports = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "pool-metrics", "containerPort": 8081, "protocol": "TCP"} in head_ports
    worker_ports = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "actor-metrics", "containerPort": 8082, "protocol": "TCP"} in worker_ports


def containers(m):
    if m["kind"] == "RayCluster":
        templates = [m["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in m["spec"]["workerGroupSpecs"]]
    elif m["kind"] == "Deployment":
        templates = [m["spec"]["template"]]
    else:
        return []
    return [(t["spec"], c) for t in templates for c in t["spec"]["containers"]]


@pytest.mark.parametrize("name", SPECS)
def test_pods_are_hardened(name):
    seen = 0
    for m in render(SPECS[name]):
        for pod, c in containers(m):
            seen += 1
            sc, psc = c["securityContext"], pod["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
            assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert any(not v.get("readOnly") for v in c["volumeMounts"])  # writable scratch (emptyDir)
            assert pod["automountServiceAccountToken"] is False
    assert seen >= 4


def test_component_commands_follow_the_contracts():
    spec = SPECS["llama-pvc.yaml"]
    m = by_kind_name(render(spec, prefill=2, decode=3))
    router = m[("Deployment", "llama3-8b-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["command"] == ["splitserve"]
    assert router["args"] == ["router", "--host", "0.0.0.0", "--port", "8000",
                              "--model", "/models/Meta-Llama-3-8B-Instruct",
                              "--served-model-name", "llama-3-8b-instruct",
                              "--redis-url", "$(SPLITSERVE_REDIS_URL)", "--cluster", "inference.llama3-8b",
                              "--cluster-token-file", "/etc/splitserve/cluster-token/token", "--block-size", "16", "--max-model-len", "8192"]
    decode_dep = m[("Deployment", "llama3-8b-decode")]
    decode = decode_dep["spec"]["template"]["spec"]["containers"][0]
    engine = ["--served-model-name", "llama-3-8b-instruct", "--block-size", "16", "--device", "cuda",
              "--dtype", "bfloat16"]
    assert decode["args"] == ["decode-worker", "--model", "/models/Meta-Llama-3-8B-Instruct", "--host", "0.0.0.0",
                              "--port", "50052", "--admin-port", "8081", "--redis-url", "$(SPLITSERVE_REDIS_URL)",
                              "--cluster", "inference.llama3-8b", "--cluster-token-file",
                              "/etc/splitserve/cluster-token/token", "--kv-backend", "grpc", "--drain-timeout", "600",
                              *engine, "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
                              "--max-model-len", "8192", "--kv-cache-memory", "40"]
    assert decode_dep["spec"]["replicas"] == 3
    env = {e["name"]: e.get("value") for e in decode["env"]}
    assert env["SPLITSERVE_REDIS_URL"] == "redis://llama3-8b-redis.inference.svc:6379/0"
    assert env["HF_HUB_OFFLINE"] == "1"
    ray = m[("RayCluster", "llama3-8b-prefill")]
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert ray["metadata"]["annotations"] == {"ray.io/overwrite-container-cmd": "true"}
    assert head["args"][0].endswith(
        "exec splitserve prefill-pool --model /models/Meta-Llama-3-8B-Instruct --replicas 2 --one-per-worker-node "
        '--redis-url "$SPLITSERVE_REDIS_URL" --cluster inference.llama3-8b '
        "--cluster-token-file /etc/splitserve/cluster-token/token --kv-backend grpc "
        "--port 50051 --metrics-port 8081 --worker-metrics-port 8082 --gpus-per-worker 1 "
        + " ".join(engine) + " --max-num-seqs 256 --max-num-batched-tokens 16384 --max-model-len 8192")
    assert '"${KUBERAY_GEN_RAY_START_CMD//--block/}"' in head["args"][0]
    (group,) = ray["spec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 8)
    assert ray["spec"]["enableInTreeAutoscaling"] is False


def test_router_stream_interval_reaches_the_router_pods(minimal_spec):
    default = by_kind_name(render(parse_spec("q", "ns", minimal_spec, "img:1")))
    args = default[("Deployment", "q-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--stream-interval" not in args  # 1: the router's own default, every token streamed
    spec = parse_spec("q", "ns", {**minimal_spec, "router": {"streamInterval": 4}}, "img:1")
    args = by_kind_name(render(spec))[("Deployment", "q-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--stream-interval") + 1] == "4"


def test_router_strict_disaggregation_reaches_the_router_pods(minimal_spec):
    def router_args(router: dict) -> list[str]:
        spec = parse_spec("q", "ns", {**minimal_spec, "router": router}, "img:1")
        return by_kind_name(render(spec))[("Deployment", "q-router")]["spec"]["template"]["spec"]["containers"][0][
            "args"]

    assert "--strict-disaggregation" not in router_args({})
    assert "--strict-disaggregation" in router_args({"strictDisaggregation": True})
    with pytest.raises(SpecError, match="spec.router.strictDisaggregation must be true or false, got 'yes'"):
        router_args({"strictDisaggregation": "yes"})


def test_decode_prefill_timeout_reaches_the_decode_pods(minimal_spec):
    def decode_args(decode: dict) -> list[str]:
        spec = parse_spec("q", "ns", {**minimal_spec, "decode": {**minimal_spec.get("decode", {}), **decode}}, "img:1")
        return by_kind_name(render(spec))[("Deployment", "q-decode")]["spec"]["template"]["spec"]["containers"][0][
            "args"]

    assert "--prefill-timeout" not in decode_args({})  # 30 s, the worker's own default
    args = decode_args({"prefillTimeoutSeconds": 120})
    assert args[args.index("--prefill-timeout") + 1] == "120"
    args = decode_args({"prefillTimeoutSeconds": 2.5})
    assert args[args.index("--prefill-timeout") + 1] == "2.5"
    with pytest.raises(SpecError, match=r"spec.decode.prefillTimeoutSeconds must be a number, got 'long'"):
        decode_args({"prefillTimeoutSeconds": "long"})


def test_decode_tensor_parallel_size_requests_its_gpus_and_passes_the_flag(minimal_spec):
    default = by_kind_name(render(parse_spec("q", "ns", minimal_spec, "img:1")))
    args = default[("Deployment", "q-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tensor-parallel-size" not in args
    decode = {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 4}}}
    spec = parse_spec("q", "ns", {**minimal_spec, "decode": decode}, "img:1")
    c = by_kind_name(render(spec))[("Deployment", "q-decode")]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "4"
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # one GPU per rank, in the one pod


def test_prefill_tensor_parallel_size_requests_its_gpus_and_passes_the_flag(minimal_spec):
    """The prefill pool's Ray worker pods hold each TP worker's ranks: 4 GPUs a pod, 4 per
    actor (--gpus-per-worker), and the flag on the pool's command line."""
    prefill = {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 4}}}
    ray = by_kind_name(render(parse_spec("q", "ns", {**minimal_spec, "prefill": prefill}, "img:1")))[
        ("RayCluster", "q-prefill")]
    command = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0].split()
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    assert command[command.index("--gpus-per-worker") + 1] == "4"
    assert command[command.index("--device") + 1] == "cuda"
    worker = ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4  # one GPU per rank, in the one pod


def test_rdma_and_image_source():
    m = by_kind_name(render(SPECS["mistral-image-rdma.yaml"]))
    decode_pod = m[("Deployment", "mistral-7b-decode")]["spec"]["template"]["spec"]
    args = decode_pod["containers"][0]["args"]
    assert args[args.index("--kv-backend"):args.index("--kv-backend") + 6] == [
        "--kv-backend", "mooncake", "--rdma-device", "mlx5_0", "--kv-protocol", "rdma"]
    assert args[args.index("--model") + 1] == "/opt/models/Mistral-7B-Instruct-v0.3"
    assert not any(v["name"] == "model" for v in decode_pod["volumes"])  # baked into the image
    assert decode_pod["imagePullSecrets"] == [{"name": "registry-internal"}]
    assert ("Deployment", "mistral-7b-redis") not in m  # external Redis
    env = {e["name"]: e.get("value") for e in decode_pod["containers"][0]["env"]}
    assert env["SPLITSERVE_REDIS_URL"] == "redis://redis-ha.platform.svc:6379/3"


def test_host_path_source_and_tokenizer(minimal_spec):
    minimal_spec["model"] = {"servedName": "m", "source": {"type": "hostPath", "hostPath": "/data/models"},
                             "path": "qwen", "tokenizer": "qwen-tokenizer", "maxModelLen": 4096, "dtype": "float32"}
    spec = parse_spec("q", "ns", minimal_spec, "img:1")
    m = by_kind_name(render(spec))
    pod = m[("Deployment", "q-router")]["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/qwen-tokenizer"  # the router only tokenizes
    assert args[-2:] == ["--max-model-len", "4096"]
    decode = m[("Deployment", "q-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert decode[decode.index("--model") + 1] == "/models/qwen"
    assert decode[decode.index("--device") + 1] == "cpu"  # no GPU requested
    assert decode[decode.index("--dtype") + 1] == "float32"
    assert decode[decode.index("--max-model-len") + 1] == "4096"


def test_decode_scale_down_drains():
    m = by_kind_name(render(SPECS["llama-pvc.yaml"]))
    pod = m[("Deployment", "llama3-8b-decode")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    # The drain endpoint is loopback-only: the hook runs inside the pod, never an httpGet from the node.
    assert c["lifecycle"]["preStop"] == {"exec": {"command": ["splitserve", "drain", "--port", "8083",
                                                             "--timeout", "630"]}}
    assert pod["terminationGracePeriodSeconds"] > 600  # the drain timeout, plus margin
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8081}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": 8081}  # /health is 503 while draining
    strategy = m[("Deployment", "llama3-8b-decode")]["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}


def test_network_policies_let_the_operator_reach_redis(minimal_spec):
    m = by_kind_name(render(parse_spec("q", "ns", minimal_spec, "img:1")))
    redis_np = m[("NetworkPolicy", "q-redis")]["spec"]["ingress"][0]
    assert {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "splitserve-operator"}}} \
        in redis_np["from"]
    assert m[("NetworkPolicy", "q-router")]["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]


def test_unwanted_children_are_the_ones_turned_off(minimal_spec):
    spec = parse_spec("q", "ns", minimal_spec, "img:1")
    assert unwanted_children(spec, "2.60.0") == [
        ("cert-manager.io/v1", "Certificate", "q-tls"),  # no spec.tls
        ("monitoring.coreos.com/v1", "PodMonitor", "q-decode"), ("monitoring.coreos.com/v1", "PodMonitor", "q-prefill"),
        ("monitoring.coreos.com/v1", "ServiceMonitor", "q-router")]
    assert unwanted_children(SPECS["llama-pvc.yaml"], "2.60.0") == [("cert-manager.io/v1", "Certificate", "llama3-8b-tls")]
    assert ("apps/v1", "Deployment", "mistral-7b-redis") in unwanted_children(SPECS["mistral-image-rdma.yaml"], "2.60.0")


def test_rendering_is_deterministic():
    spec = SPECS["llama-pvc.yaml"]
    assert render(spec) == render(spec)


def test_drift_ignores_server_additions_but_not_edits():
    desired = {"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "a", "args": ["x"],
                                                                            "resources": {"limits": {"cpu": 1}}}]}}}}
    live = {"spec": {"replicas": 2, "progressDeadlineSeconds": 600,
                     "template": {"spec": {"containers": [{"name": "a", "args": ["x"], "imagePullPolicy": "Always",
                                                           "resources": {"limits": {"cpu": "1"}}}]}}},
            "status": {"readyReplicas": 1}}
    assert not drifted(desired, live)
    live["spec"]["replicas"] = 7
    assert drifted(desired, live)
    live["spec"]["replicas"] = 2
    live["spec"]["template"]["spec"]["containers"][0]["args"] = ["x", "y"]
    assert drifted(desired, live)


def test_readiness_needs_rollout_done_and_ray_head():
    dep = {"metadata": {"generation": 3}, "status": {"observedGeneration": 3, "replicas": 3, "updatedReplicas": 2,
                                                     "readyReplicas": 3}}
    assert not observe_deployment(dep, 3).is_ready  # one pod still on the old template
    dep["status"]["updatedReplicas"] = 3
    assert observe_deployment(dep, 3).is_ready
    dep["status"]["observedGeneration"] = 2
    assert not observe_deployment(dep, 3).is_ready  # controller has not seen the new spec
    assert not observe_deployment(None, 1).is_ready
    ray = {"metadata": {}, "status": {"readyWorkerReplicas": 2, "state": "ready"}}
    assert observe_raycluster(ray, 2).is_ready and not observe_raycluster(ray, 3).is_ready
    assert not observe_raycluster({"metadata": {}, "status": {"readyWorkerReplicas": 2}}, 2).is_ready


def test_condition_transition_time_only_moves_on_change():
    roles = {"decode": observe_deployment(None, 1)}
    first = conditions(roles, None, [], "2026-01-01T00:00:00Z", 1)
    again = conditions(roles, None, first, "2026-01-01T00:05:00Z", 1)
    ready = {c["type"]: c for c in again}["Ready"]
    assert ready["status"] == "False" and ready["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert ready["message"] == "waiting for decode 0/1 ready (missing)"
