"""The kopf handlers, run by kopf itself against the FAKE Kubernetes API server in
fake_kube.py (no real API server can run here). The fake plays the controllers'
part by writing children's status; everything else is the operator for real."""

from __future__ import annotations

import asyncio
import copy
import shutil
import socket
import subprocess
import threading
import time

import kopf
import pytest
import redis
import yaml

from splitserve.cluster.messages import LoadReport, encode, key_prefix
from splitserve.operator.render import Replicas, key, render_all
from splitserve.operator.spec import parse_spec

from .fake_kube import FakeKube

NS = "demo"
IFD = ("splitserve.io/v1alpha1", "inferencedeployments")
KINDS = {
    IFD: "InferenceDeployment", ("apps/v1", "deployments"): "Deployment", ("v1", "services"): "Service",
    ("ray.io/v1", "rayclusters"): "RayCluster", ("policy/v1", "poddisruptionbudgets"): "PodDisruptionBudget",
    ("networking.k8s.io/v1", "networkpolicies"): "NetworkPolicy",
    ("monitoring.coreos.com/v1", "servicemonitors"): "ServiceMonitor",
    ("monitoring.coreos.com/v1", "podmonitors"): "PodMonitor", ("v1", "secrets"): "Secret",
    ("cert-manager.io/v1", "certificates"): "Certificate",
}
PLURAL = {kind: plural for (_, plural), kind in KINDS.items()}


async def wait_for(predicate, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def run_operator(fake: FakeKube, tmp_path, monkeypatch):
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    monkeypatch.setenv("KUBECONFIG", str(path))
    from splitserve.operator import handlers  # noqa: F401 - registers the handlers

    # kopf gets its own thread and event loop: at shutdown it cancels every task left
    # in its loop, which must not include the test's own tasks.
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
        standalone=True, namespaces=[NS], stop_flag=stop, ready_flag=ready)), daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 15), "kopf did not become ready"
    return stop, thread


async def stop_operator(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    await asyncio.to_thread(thread.join, 15)
    assert not thread.is_alive(), "kopf did not stop within 15s"


def infd(name: str, spec: dict) -> dict:
    return {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NS}, "spec": copy.deepcopy(spec)}


def child(fake: FakeKube, kind: str, name: str) -> dict | None:
    gv = next(gv for (gv, plural), k in KINDS.items() if k == kind)
    return fake.get(gv, PLURAL[kind], NS, name)


def condition(fake: FakeKube, name: str, type_: str) -> dict | None:
    obj = fake.get(*IFD, NS, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def expected_children(name: str, spec: dict) -> set[tuple[str, str, str]]:
    parsed = parse_spec(name, NS, spec, "registry.example/splitserve:test")
    return {key(m) for m in render_all(parsed, Replicas(parsed.prefill.replicas, parsed.decode.replicas), "2.60.0")}


async def test_create_makes_owned_children_and_ready_waits_for_every_role(cluster, minimal_spec):
    fake = cluster
    created = await fake.create(*IFD, NS, infd("llama", minimal_spec))
    uid = created["metadata"]["uid"]
    wanted = expected_children("llama", minimal_spec)
    await wait_for(lambda: all(child(fake, k, n) for _, k, n in wanted), "every child to be created")
    for _, kind, name in wanted:
        refs = child(fake, kind, name)["metadata"]["ownerReferences"]
        assert refs == [{"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment", "name": "llama",
                         "uid": uid, "controller": True, "blockOwnerDeletion": True}], (kind, name)

    ready = await wait_for(lambda: condition(fake, "llama", "Ready"), "a Ready condition")
    assert ready["status"] == "False" and ready["reason"] == "RolesNotReady"
    assert "router 0/2 ready" in ready["message"] and "decode 0/1 ready" in ready["message"]

    # The fake plays the Deployment controller for the router and decode workers...
    for name, n in (("llama-router", 2), ("llama-decode", 1)):
        gen = child(fake, "Deployment", name)["metadata"]["generation"]
        await fake.set_status("apps/v1", "deployments", NS, name, {
            "observedGeneration": gen, "replicas": n, "updatedReplicas": n, "readyReplicas": n})
    await wait_for(lambda: "prefill 0/1" in (condition(fake, "llama", "Ready") or {}).get("message", ""),
                   "Ready to wait only for prefill")
    assert condition(fake, "llama", "Ready")["status"] == "False"
    # ...a RayCluster with ready workers but no ready head is still not ready...
    await fake.set_status("ray.io/v1", "rayclusters", NS, "llama-prefill", {"readyWorkerReplicas": 1})
    await asyncio.sleep(1.0)
    assert condition(fake, "llama", "Ready")["status"] == "False"
    # ...and KubeRay reporting the head ready completes it.
    await fake.set_status("ray.io/v1", "rayclusters", NS, "llama-prefill", {
        "readyWorkerReplicas": 1, "conditions": [{"type": "HeadPodReady", "status": "True"}]})
    await wait_for(lambda: (condition(fake, "llama", "Ready") or {}).get("status") == "True", "Ready=True")
    status = fake.get(*IFD, NS, "llama")["status"]
    assert status["prefillReplicas"] == "1/1" and status["decodeReplicas"] == "1/1"
    assert status["router"] == {"ready": 2, "desired": 2}
    assert condition(fake, "llama", "Degraded")["status"] == "False"


async def test_spec_change_patches_children_and_toggles_optional_ones(cluster, minimal_spec):
    fake = cluster
    await fake.create(*IFD, NS, infd("llama", minimal_spec))
    await wait_for(lambda: child(fake, "Deployment", "llama-decode"), "decode Deployment")
    await fake.patch_spec(*IFD, NS, "llama", {"spec": {"decode": {"maxNumSeqs": 64},
                                                       "monitoring": {"serviceMonitor": True}}})

    def args():
        d = child(fake, "Deployment", "llama-decode")
        return d["spec"]["template"]["spec"]["containers"][0]["args"]
    await wait_for(lambda: args()[args().index("--max-num-seqs") + 1] == "64", "decode args patched")
    await wait_for(lambda: child(fake, "ServiceMonitor", "llama-router"), "ServiceMonitor created")

    await fake.patch_spec(*IFD, NS, "llama", {"spec": {"monitoring": {"serviceMonitor": False}}})
    await wait_for(lambda: child(fake, "ServiceMonitor", "llama-router") is None, "ServiceMonitor deleted")


async def test_deleted_or_edited_child_is_restored(cluster, minimal_spec):
    fake = cluster
    await fake.create(*IFD, NS, infd("llama", minimal_spec))
    old = await wait_for(lambda: child(fake, "Service", "llama-router"), "router Service")
    await fake.remove("v1", "services", NS, "llama-router")
    new = await wait_for(lambda: child(fake, "Service", "llama-router"), "router Service recreated")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    # Hand-edit drift (someone scales the router to 7) is re-applied too.
    await fake.patch_spec("apps/v1", "deployments", NS, "llama-router", {"spec": {"replicas": 7}})
    await wait_for(lambda: child(fake, "Deployment", "llama-router")["spec"]["replicas"] == 2,
                   "router replicas restored")


async def test_invalid_spec_is_degraded_not_crashing(cluster, minimal_spec):
    fake = cluster
    bad = copy.deepcopy(minimal_spec)
    bad["decode"] = {"replicas": 3, "minReplicas": 3, "maxReplicas": 2}
    await fake.create(*IFD, NS, infd("broken", bad))
    degraded = await wait_for(lambda: condition(fake, "broken", "Degraded"), "Degraded condition")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "spec.decode.minReplicas (3) must be <= spec.decode.maxReplicas (2)" in degraded["message"]
    assert condition(fake, "broken", "Ready")["status"] == "False"
    assert fake.list("apps/v1", "deployments", NS) == []
    # Fixing the spec recovers without restarting anything.
    await fake.patch_spec(*IFD, NS, "broken", {"spec": {"decode": {"maxReplicas": 4}}})
    await wait_for(lambda: condition(fake, "broken", "Degraded")["status"] == "False", "Degraded cleared")
    assert child(fake, "Deployment", "broken-decode")["spec"]["replicas"] == 3


async def test_missing_kuberay_crd_is_reported(tmp_path, monkeypatch, minimal_spec):
    fake = FakeKube({k: v for k, v in KINDS.items() if v != "RayCluster"})
    await fake.start()
    await fake.create_namespace(NS)
    stop, thread = await run_operator(fake, tmp_path, monkeypatch)
    try:
        await fake.create(*IFD, NS, infd("llama", minimal_spec))
        degraded = await wait_for(
            lambda: (c := condition(fake, "llama", "Degraded")) and c["status"] == "True" and c, "Degraded")
        assert degraded["reason"] == "ApplyFailed"
        assert "RayCluster llama-prefill" in degraded["message"] and "KubeRay" in degraded["message"]
        assert child(fake, "Deployment", "llama-decode") is not None  # the rest is still applied
    finally:
        await stop_operator(stop, thread)
        await fake.stop()


@pytest.fixture
def redis_url(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (scripts/setup.sh installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


async def test_autoscaler_scales_decode_from_bus_load_and_holds_prefill(cluster, minimal_spec, redis_url):
    fake = cluster
    spec = {**minimal_spec, "redis": {"url": redis_url},
            "autoscaling": {"targetWaitingPerReplica": 2, "scaleUpWindowSeconds": 0}}
    await fake.create(*IFD, NS, infd("llama", spec))
    await wait_for(lambda: child(fake, "Deployment", "llama-decode"), "decode Deployment")
    assert child(fake, "Deployment", "llama-redis") is None  # external Redis: none deployed
    r = redis.Redis.from_url(redis_url)
    for worker in ("decode-a", "decode-b"):  # 20 waiting over 1 replica, target 2 -> +maxStep (2)
        report = LoadReport(worker_id=worker, role="decode", waiting=10, running=4, kv_usage=0.5)
        r.set(f"{key_prefix('demo.llama')}load:{worker}", encode(report), ex=30)
    await wait_for(lambda: child(fake, "Deployment", "llama-decode")["spec"]["replicas"] == 3, "decode scaled to 3")
    # kopf writes the status patch after the handler has applied the children.
    await wait_for(lambda: fake.get(*IFD, NS, "llama")["status"]["decode"]["desired"] == 3, "status desired 3")
    status = fake.get(*IFD, NS, "llama")["status"]
    assert "lastScaleTime" in status
    assert status["queue"] == 20
    assert "no load reports" in status["autoscaler"]["prefill"]
    assert fake.get("ray.io/v1", "rayclusters", NS, "llama-prefill")["spec"]["workerGroupSpecs"][0]["replicas"] == 1
