"""The cluster token in Kubernetes: the real kopf operator against the fake API server
creates one token Secret per InferenceDeployment, owned by it, mounts it into every
pod and passes --cluster-token-file to every component; deleting the Secret rotates
the token and rolls the pods. A real `splitserve router` holding the token refuses a
real decode worker started without it (its registration on the Redis bus is unsigned),
and routes to one started with it."""

from __future__ import annotations

import base64
import time

import requests

from splitserve.operator.cluster_token import token_hash
from tests.reliability.cluster import Cluster

from .fake_kube import FakeKube
from .test_kopf_handlers import IFD, NS, child, infd, wait_for

SECRETS = ("v1", "secrets")
TOKEN_FILE = "/etc/splitserve/cluster-token/token"
HASH = "splitserve.io/cluster-token-hash"


def pod_templates(fake: FakeKube, name: str) -> dict[str, dict]:
    ray = child(fake, "RayCluster", f"{name}-prefill")["spec"]
    return {"router": child(fake, "Deployment", f"{name}-router")["spec"]["template"],
            "decode": child(fake, "Deployment", f"{name}-decode")["spec"]["template"],
            "ray-head": ray["headGroupSpec"]["template"],
            "ray-worker": ray["workerGroupSpecs"][0]["template"]}


async def test_the_secret_is_created_owned_mounted_and_rotated(cluster, minimal_spec):
    fake = cluster
    created = await fake.create(*IFD, NS, infd("llama", minimal_spec))
    secret = await wait_for(lambda: child(fake, "Secret", "llama-cluster-token"), "the token Secret")
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment", "name": "llama",
         "uid": created["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 40  # 32 random bytes, URL-safe base64
    await wait_for(lambda: child(fake, "RayCluster", "llama-prefill") and child(fake, "Deployment", "llama-decode"),
                   "every workload")
    templates = pod_templates(fake, "llama")
    for role, t in templates.items():
        pod = t["spec"]
        assert {"name": "cluster-token", "secret": {"secretName": "llama-cluster-token", "defaultMode": 0o440,
                                                     "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
        for c in pod["containers"]:
            assert {"name": "cluster-token", "mountPath": "/etc/splitserve/cluster-token",
                    "readOnly": True} in c["volumeMounts"], (role, c["name"])
        assert t["metadata"]["annotations"][HASH] == token_hash(secret), role
    for role in ("router", "decode"):
        args = templates[role]["spec"]["containers"][0]["args"]
        assert args[args.index("--cluster-token-file") + 1] == TOKEN_FILE, role
    # The pool driver reads the file and hands the token to its actors on the Ray workers.
    assert f"--cluster-token-file {TOKEN_FILE}" in templates["ray-head"]["spec"]["containers"][0]["args"][0]
    assert token not in str(templates)  # only the file path and a hash, never the token

    await fake.remove(*SECRETS, NS, "llama-cluster-token")  # rotate
    rotated = await wait_for(lambda: (s := child(fake, "Secret", "llama-cluster-token")) and
                             s["data"] != secret["data"] and s, "a new token Secret")
    assert rotated["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    await wait_for(lambda: all(t["metadata"]["annotations"][HASH] == token_hash(rotated)
                               for t in pod_templates(fake, "llama").values()), "every pod template to roll")


def test_a_worker_without_the_token_is_refused(make_ckpt, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("the-cluster-token-of-this-test\n")
    with_token = Cluster(make_ckpt("llama"), tmp_path, tls_args=["--cluster-token-file", str(token_file)],
                         decode_step_ms=0)
    with_token.start_redis()
    without = Cluster(with_token.model, tmp_path, redis_port=with_token.redis_port, decode_step_ms=0)
    try:
        router = with_token.start_router()
        intruder = without.start_decode("decode-intruder")
        refusal = ("worker decode-intruder (decode at " + intruder.match.group(1) + "): its registration is not "
                   "signed; this cluster requires its cluster token")
        deadline = time.monotonic() + 20
        while refusal not in router.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert refusal in router.log()
        assert requests.get(router.base_url + "/health", timeout=10).json()["decode_workers"] == []
        with_token.start_decode("decode-0")
        assert with_token.wait_registered(router)["decode_workers"] == ["decode-0"]
        r = requests.post(router.base_url + "/v1/completions", timeout=60,
                          json={"model": "tiny-llama", "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and "decode=decode-0" in r.headers["X-Splitserve-Route"], r.text
    finally:
        without.stop()
        with_token.stop()
