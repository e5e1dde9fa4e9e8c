"""Scale to zero end to end: the real kopf operator against the fake API server (its
autoscaler reading load from a real redis-server), a real `splitserve router` started
with the flags the operator renders for it, and a real decode worker process started by
the test in place of the pod the operator scales up.

Idle decode goes to 0 replicas; a request arriving then is held (counted in
splitserve_router_held_requests), the operator scales decode to 1 on that count, and the
request completes once the worker registers. Past the hold limits the client gets 503
with Retry-After in OpenAI's error format. /v1/models lists the model throughout."""

from __future__ import annotations

import asyncio
import base64
import re
import threading
import time

import pytest
import redis
import requests

from splitserve.cluster.messages import LoadReport, encode, key_prefix
from tests.reliability.cluster import SERVED, Cluster

from .fake_kube import FakeKube
from .test_kopf_handlers import IFD, KINDS, NS, child, infd, run_operator, stop_operator, wait_for

BODY = {"model": SERVED, "prompt": "hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
async def stack(tmp_path, monkeypatch, make_ckpt):
    fake = FakeKube(KINDS)
    await fake.start()
    await fake.create_namespace(NS)
    stop, thread = await run_operator(fake, tmp_path, monkeypatch)
    procs = Cluster(make_ckpt("llama"), tmp_path, decode_step_ms=0)
    procs.start_redis()
    yield fake, procs
    procs.stop()
    await stop_operator(stop, thread)
    await fake.stop()


def decode_replicas(fake: FakeKube) -> int | None:
    d = child(fake, "Deployment", "llama-decode")
    return d["spec"]["replicas"] if d else None


def held(router) -> float:
    text = requests.get(router.base_url + "/metrics", timeout=10).text
    return float(re.search(r"^splitserve_router_held_requests (\S+)$", text, re.M).group(1))


def listed(router) -> list[str]:
    return [m["id"] for m in requests.get(router.base_url + "/v1/models", timeout=10).json()["data"]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


async def test_idle_decode_goes_to_zero_and_a_held_request_brings_it_back(stack, minimal_spec, tmp_path):
    fake, procs = stack
    spec = {**minimal_spec, "redis": {"url": procs.redis_url}, "decode": {"minReplicas": 0},
            "autoscaling": {"scaleDownWindowSeconds": 0, "scaleToZeroAfterSeconds": 1, "holdRequestsAtZero": 2,
                            "holdTimeoutSeconds": 120}}
    await fake.create(*IFD, NS, infd("llama", spec))
    secret = await wait_for(lambda: child(fake, "Secret", "llama-cluster-token"), "the token Secret")
    token_file = tmp_path / "token"  # what the pods get mounted
    token_file.write_bytes(base64.b64decode(secret["data"]["token"]))
    procs.tls_args = ["--cluster", f"{NS}.llama", "--cluster-token-file", str(token_file)]

    # An idle decode worker's reports: after the idle window the operator scales decode to 0.
    bus = redis.Redis.from_url(procs.redis_url)
    report = f"{key_prefix(f'{NS}.llama')}load:decode-old"
    bus.set(report, encode(LoadReport("decode-old", "decode", waiting=0, running=0, kv_usage=0.0)), ex=30)
    await wait_for(lambda: decode_replicas(fake) == 0, "decode scaled to zero", timeout=30)
    bus.delete(report)  # that pod is gone

    # The router as the operator renders it.
    container = child(fake, "Deployment", "llama-router")["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    args = container["args"]
    hold = ["--hold-requests-at-zero", flag(args, "--hold-requests-at-zero"),
            "--hold-timeout", flag(args, "--hold-timeout")]
    assert hold == ["--hold-requests-at-zero", "2", "--hold-timeout", "120"]
    router = await asyncio.to_thread(procs.start_router, hold)
    assert listed(router) == [SERVED]
    health = requests.get(router.base_url + "/health", timeout=10)  # the router's readiness probe
    assert health.status_code == 200 and health.json()["status"] == "scaled to zero: holding requests"

    request = asyncio.create_task(asyncio.to_thread(requests.post, router.base_url + "/v1/completions",
                                                    json=BODY, timeout=180))
    await wait_for(lambda: held(router) == 1, "the request held at zero")
    await wait_for(lambda: decode_replicas(fake) == 1, "decode scaled up from zero on the held count", timeout=30)
    assert not request.done() and listed(router) == [SERVED]

    await asyncio.to_thread(procs.start_decode, "decode-0")  # the pod the operator asked for
    r = await asyncio.wait_for(request, 120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and "decode=decode-0" in r.headers["X-Splitserve-Route"]
    assert held(router) == 0 and listed(router) == [SERVED]


def test_past_the_hold_limits_the_client_gets_503_with_retry_after(stack):
    _, procs = stack
    procs.tls_args = ["--cluster", "demo.no-workers"]
    router = procs.start_router(["--hold-requests-at-zero", "1", "--hold-timeout", "2"])
    assert listed(router) == [SERVED]
    without_hold = procs.start_router()  # the default: no worker, not ready, 503 after --no-worker-wait
    assert requests.get(without_hold.base_url + "/health", timeout=10).status_code == 503
    url = router.base_url + "/v1/completions"
    started = time.monotonic()
    with requests.Session() as first:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=first.post(url, json=BODY, timeout=30)))
        t.start()
        deadline = time.monotonic() + 10
        while held(router) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        full = requests.post(url, json=BODY, timeout=30)  # a second one while one is held: at once
        assert full.status_code == 503 and full.headers["Retry-After"] == "30"
        error = full.json()["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "held_at_zero_full")
        assert "--hold-requests-at-zero 1" in error["message"]
        t.join(30)
    timed_out = result["r"]
    assert timed_out.status_code == 503 and timed_out.headers["Retry-After"] == "30"
    assert timed_out.json()["error"]["code"] == "no_workers_at_zero"
    assert "held 2s (--hold-timeout)" in timed_out.json()["error"]["message"]
    assert time.monotonic() - started >= 2
    assert held(router) == 0 and listed(router) == [SERVED]
