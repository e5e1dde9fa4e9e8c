"""spec.redis.urlSecretRef with the real kopf operator against the fake API server: the
pods get the URL from the Secret, and the autoscaler reads it from there (a real
redis-server holds the load reports); a missing Secret holds scaling with a reason
that names it, and a password never shows."""

from __future__ import annotations

import base64

import pytest
import redis

from splitserve.cluster.messages import LoadReport, encode, key_prefix
from splitserve.operator.loadreports import redacted

from .fake_kube import FakeKube
from .test_kopf_handlers import (
    IFD,
    KINDS,
    NS,
    child,
    infd,
    redis_url,
    run_operator,
    stop_operator,
    wait_for,
)

__all__ = ["redis_url"]  # the fixture, used by name
SECRETS = ("v1", "secrets")


@pytest.fixture
async def cluster(tmp_path, monkeypatch):
    fake = FakeKube({**KINDS, SECRETS: "Secret"})
    await fake.start()
    await fake.create_namespace(NS)
    stop, thread = await run_operator(fake, tmp_path, monkeypatch)
    yield fake
    await stop_operator(stop, thread)
    await fake.stop()


def autoscaler_status(fake: FakeKube, name: str) -> dict:
    return ((fake.get(*IFD, NS, name) or {}).get("status") or {}).get("autoscaler") or {}


async def test_autoscaler_reads_the_redis_url_from_the_secret(cluster, minimal_spec, redis_url):
    fake = cluster
    password_url = redis_url.replace("redis://", "redis://:not-a-real-password@")  # no auth: ignored
    await fake.create(*SECRETS, NS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "bus", "namespace": NS},
                                     "data": {"url": base64.b64encode(password_url.encode()).decode()}})
    spec = {**minimal_spec, "redis": {"urlSecretRef": {"name": "bus", "key": "url"}},
            "autoscaling": {"targetWaitingPerReplica": 2, "scaleUpWindowSeconds": 0}}
    await fake.create(*IFD, NS, infd("llama", spec))
    decode = await wait_for(lambda: child(fake, "Deployment", "llama-decode"), "decode Deployment")
    assert {"name": "SPLITSERVE_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "bus", "key": "url"}}} \
        in decode["spec"]["template"]["spec"]["containers"][0]["env"]
    assert child(fake, "Deployment", "llama-redis") is None
    r = redis.Redis.from_url(redis_url)
    report = LoadReport(worker_id="decode-a", role="decode", waiting=10, running=4, kv_usage=0.5)
    r.set(f"{key_prefix('demo.llama')}load:decode-a", encode(report), ex=30)
    await wait_for(lambda: child(fake, "Deployment", "llama-decode")["spec"]["replicas"] == 3, "decode scaled to 3")


async def test_a_missing_secret_holds_scaling_and_says_which(cluster, minimal_spec):
    fake = cluster
    spec = {**minimal_spec, "redis": {"urlSecretRef": {"name": "nope", "key": "url"}}}
    await fake.create(*IFD, NS, infd("llama", spec))
    reason = "cannot read the Redis URL: Secret demo/nope key 'url' (spec.redis.urlSecretRef) does not exist"
    status = await wait_for(lambda: autoscaler_status(fake, "llama").get("decode"), "autoscaler reason")
    assert status == f"{reason}: holding at 1"
    assert child(fake, "Deployment", "llama-decode")["spec"]["replicas"] == 1


def test_passwords_are_redacted():
    assert redacted("rediss://:s3cret@redis.platform.svc:6380/0") == "rediss://:***@redis.platform.svc:6380/0"
    assert redacted("redis://user:s3cret@r:6379") == "redis://user:***@r:6379"
    assert redacted("redis://r:6379/0") == "redis://r:6379/0"
