"""Optional mutual TLS from cert-manager (spec.tls.certManager): one Certificate per
InferenceDeployment, created and owned by the real kopf operator against the fake API
server and deleted when spec.tls goes; its Secret mounted into every pod and the
--tls-* flags passed to every component. Then a real router and a real decode worker,
started with exactly the rendered flags over a certificate that names only the
deployment's server name (peers are dialled by IP), serve a request over mutual TLS."""

from __future__ import annotations

import asyncio
import shutil

import requests

from splitserve.operator.cert_manager import server_name
from tests.reliability.cluster import SERVED, Cluster
from tests.security.certs import make_pki

from .fake_kube import FakeKube
from .test_kopf_handlers import IFD, NS, child, infd, wait_for

TLS = {"certManager": {"issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"}}}


def containers(fake: FakeKube) -> dict[str, dict]:
    ray = child(fake, "RayCluster", "llama-prefill")["spec"]
    return {"router": child(fake, "Deployment", "llama-router")["spec"]["template"]["spec"],
            "decode": child(fake, "Deployment", "llama-decode")["spec"]["template"]["spec"],
            "ray-head": ray["headGroupSpec"]["template"]["spec"],
            "ray-worker": ray["workerGroupSpecs"][0]["template"]["spec"]}


async def test_the_certificate_is_owned_mounted_passed_and_removed_with_spec_tls(cluster, minimal_spec, tmp_path,
                                                                                 make_ckpt):
    fake = cluster
    created = await fake.create(*IFD, NS, infd("llama", {**minimal_spec, "tls": TLS}))
    cert = await wait_for(lambda: child(fake, "Certificate", "llama-tls"), "the Certificate")
    host = "llama.demo.splitserve.internal"
    assert server_name("llama", NS) == host
    assert cert["spec"] == {"secretName": "llama-tls", "commonName": host, "dnsNames": [host],
                            "usages": ["server auth", "client auth", "digital signature"],
                            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
                            "issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}}
    assert cert["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    await wait_for(lambda: child(fake, "RayCluster", "llama-prefill") and child(fake, "Deployment", "llama-decode"),
                   "every workload")
    flags = ["--tls-cert", "/etc/splitserve/tls/tls.crt", "--tls-key", "/etc/splitserve/tls/tls.key",
             "--tls-ca", "/etc/splitserve/tls/ca.crt", "--tls-server-name", host]
    for role, pod in containers(fake).items():
        assert {"name": "cluster-tls", "secret": {"secretName": "llama-tls", "defaultMode": 0o440, "items": [
            {"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]}} in pod["volumes"], role
        for c in pod["containers"]:
            assert {"name": "cluster-tls", "mountPath": "/etc/splitserve/tls", "readOnly": True} in c["volumeMounts"]
    for role in ("router", "decode"):
        args = containers(fake)[role]["containers"][0]["args"]
        assert args[args.index("--tls-cert"):][:8] == flags, role
    assert " ".join(flags) in containers(fake)["ray-head"]["containers"][0]["args"][0]

    # The flags work as rendered: a router and a decode worker with a certificate naming only
    # the server name, dialled by 127.0.0.1.
    pki = make_pki(tmp_path / "pki", "deployment", dns_names=[host])
    mount = tmp_path / "etc-splitserve-tls"  # stands in for /etc/splitserve/tls
    mount.mkdir()
    for src, dst in ((pki.cert, "tls.crt"), (pki.key, "tls.key"), (pki.ca, "ca.crt")):
        shutil.copy(src, mount / dst)
    rendered = [a.replace("/etc/splitserve/tls", str(mount)) for a in flags]
    procs = Cluster(make_ckpt("llama"), tmp_path, tls_args=rendered, decode_step_ms=0)
    try:
        await asyncio.to_thread(procs.start_redis)
        router = await asyncio.to_thread(procs.start_router)
        await asyncio.to_thread(procs.start_decode, "decode-0")
        await asyncio.to_thread(procs.wait_registered, router)
        r = await asyncio.to_thread(requests.post, router.base_url + "/v1/completions", timeout=60,
                                    json={"model": SERVED, "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert "mTLS" in procs.decode["decode-0"].log()
    finally:
        procs.stop()

    await fake.patch_spec(*IFD, NS, "llama", {"spec": {"tls": None}})
    await wait_for(lambda: child(fake, "Certificate", "llama-tls") is None, "the Certificate deleted")
    await wait_for(lambda: "--tls-cert" not in containers(fake)["decode"]["containers"][0]["args"], "flags gone")

