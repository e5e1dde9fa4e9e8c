"""Overload on the real cluster: the admission bound (429 + Retry-After), per-request
deadlines, clients that disconnect, and 256 concurrent streaming clients with the
processes' memory measured over repeated rounds."""

from __future__ import annotations

import asyncio
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import requests

from tests.reliability.cluster import SERVED
from tests.reliability.conftest import (
    FAULT_SEEDS,
    assert_identical,
    prompts,
    stream_completion,
    wait_for,
)

LOAD_BOUND = 256


@pytest.fixture(scope="module")
def routers(cluster):
    """Extra router replicas on the same workers: one bounded at 256 requests, one with a 1 s deadline."""
    with ThreadPoolExecutor(2) as pool:
        bounded = pool.submit(cluster.start_router, ["--max-queued-requests", str(LOAD_BOUND)])
        deadline = pool.submit(cluster.start_router, ["--request-timeout", "1"])
        bounded, deadline = bounded.result(), deadline.result()
    for r in (bounded, deadline):
        cluster.wait_registered(r)
    yield bounded, deadline
    for r in (bounded, deadline):
        r.stop()
        cluster.routers.remove(r)


def admission(base: str) -> dict:
    return requests.get(base + "/health", timeout=10).json()["admission"]


async def load_round(base: str, batch: list[list[int]], max_tokens: int):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        return await asyncio.gather(*(stream_completion(s, base, p, max_tokens) for p in batch))


def rss_mib(cluster, router) -> dict[str, float]:
    procs = {"router": router, **cluster.live(cluster.decode), **cluster.live(cluster.prefill)}
    return {name: round(p.rss_bytes() / 2**20, 1) for name, p in procs.items()}


def test_256_concurrent_streams_then_429_above_the_bound(cluster, routers, reference, record_property):
    bounded, _ = routers
    batch = prompts(20, LOAD_BOUND, 12)
    expected = reference(batch, 16)
    memory, served, wall = [], 0, []
    for _ in range(4):  # round 1 warms up; memory must stay flat over rounds 2-4
        start = time.monotonic()
        results = asyncio.run(load_round(bounded.base_url, batch, 16))
        wall.append(round(time.monotonic() - start, 2))
        assert_identical(results, expected, 16)  # at the bound: not a single error
        served += len(results)
        memory.append(rss_mib(cluster, bounded))
    assert admission(bounded.base_url)["rejected"] == 0
    cluster.wait_all_blocks_free()

    # 320 clients at once against a bound of 256: the excess is told to come back later
    over = batch + prompts(21, 64, 12)
    results = asyncio.run(load_round(bounded.base_url, over, 16))
    ok = [r for r in results if r.status == 200]
    rejected = [r for r in results if r.status == 429]
    assert len(ok) + len(rejected) == len(over) and len(ok) >= LOAD_BOUND and rejected
    assert_identical(ok, reference([over[i] for i, r in enumerate(results) if r.status == 200], 16), 16)
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        err = r.body["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests_in_flight"
        assert f"--max-queued-requests {LOAD_BOUND}" in err["message"]
    served += len(ok)
    assert admission(bounded.base_url)["in_flight"] == 0
    cluster.wait_all_blocks_free()
    peak = {name: max(m[name] for m in memory) for name in memory[0]}
    for name in memory[0]:  # flat: no growth from round 2 to round 4 beyond allocator noise
        assert memory[3][name] - memory[1][name] < max(16.0, 0.05 * memory[1][name]), (name, memory)
    record_property("load", {"served": served, "rejected": len(rejected), "round_seconds": wall,
                             "rss_mib_per_round": memory, "peak_rss_mib": peak})
    print(json.dumps({"served": served, "rejected": len(rejected), "round_seconds": wall,
                      "rss_mib_per_round": memory, "peak_rss_mib": peak}))


def test_deadline_aborts_the_request_everywhere(cluster, routers):
    _, deadline = routers
    prompt = prompts(30, 1, 20)[0]
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    r = requests.post(deadline.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 504, r.text[:300]  # a 3,000-token generation cut by the 1 s deadline
    err = r.json()["error"]
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error" and "1.0s" in err["message"]
    cluster.wait_all_blocks_free(timeout=10)

    async def stream():
        async with aiohttp.ClientSession() as s:
            return await stream_completion(s, deadline.base_url, prompt, 3000)

    res = asyncio.run(stream())
    assert res.status == 200 and res.done and 0 < len(res.tokens) < 3000
    assert [e["code"] for e in res.errors] == ["request_timeout"]
    cluster.wait_all_blocks_free(timeout=10)
    assert admission(deadline.base_url)["in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
@pytest.mark.parametrize("path", ["local-prefill", "disaggregated"])
def test_client_disconnect_aborts_on_every_worker(cluster, stream, path):
    """The client goes away mid-request; the decode worker aborts, a remote prefill in
    progress is cancelled and its lease released, every block comes back."""
    base = cluster.router.base_url
    prompt = prompts(40 + stream, 1, 20 if path == "local-prefill" else 90)[0]
    rid = f"disconnect-{path}-{stream}-{time.monotonic_ns()}"
    health = cluster.prefill["prefill-0"].match.group(2) + "/health"

    async def go():
        body = {"model": SERVED, "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
                "stream": stream, "seed": FAULT_SEEDS["slow"]}  # slow: the prefill waits before pushing
        async with aiohttp.ClientSession() as s:

            async def call():
                async with s.post(base + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
                    await resp.content.readline()  # stream: the first token; non-stream: never before the end
                    await asyncio.sleep(3600)

            task = asyncio.create_task(call())
            if path == "disaggregated":  # leave while the prefill worker holds the KV
                await asyncio.to_thread(wait_for, lambda: requests.get(health, timeout=5).json()["kv"]["waiters"],
                                        20, "the prefill to start")
            else:
                await asyncio.to_thread(wait_for, lambda: any(s["sequences"] for s in cluster.kv_states().values()),
                                        20, "the request to run")
                await asyncio.sleep(0.3)  # decoding
            assert not task.done()
            task.cancel()  # drops the connection
            await asyncio.gather(task, return_exceptions=True)

    before = sum(s["free_blocks"] for s in cluster.kv_states().values())
    asyncio.run(go())
    states = cluster.wait_all_blocks_free(timeout=15)
    assert sum(s["free_blocks"] for s in states.values()) >= before
    wait_for(lambda: admission(base)["in_flight"] == 0, 10, "the router to release the request's slot")


def test_retry_after_estimate_is_bounded():
    from splitserve.router.admission import RETRY_AFTER_MAX_S, retry_after_seconds

    assert retry_after_seconds([], 10, 10) == 1
    assert retry_after_seconds([4.0] * 9, 8, 8) == 1  # a slot frees every 0.5 s
    assert retry_after_seconds([4.0] * 9, 8, 4) == math.ceil(4.0 * 5 / 8)
    assert retry_after_seconds([1000.0], 2, 1) == RETRY_AFTER_MAX_S
