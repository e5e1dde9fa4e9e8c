"""Faults injected into a real cluster (separate OS processes). After each: every request
completed with exactly the greedy tokens of an undisturbed run, nothing duplicated or
missing in the client's stream, and every live worker's free KV blocks back to its total.
The tests run in file order; each leaves the cluster with 2 decode + 1 prefill workers."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import redis
import requests

from tests.reliability.conftest import (
    FAULTY_PREFILL,
    StreamResult,
    assert_identical,
    complete,
    metric,
    prompts,
    served_by,
    stream_completion,
    wait_for,
)

MAX = 200  # tokens per stream: long enough to be cut in the middle


async def streams_with_fault(base: str, batch: list[list[int]], max_tokens: int, fault, min_chunks: int = 4,
                             ids: list[str] | None = None, allow_finished: bool = False) -> list[StreamResult]:
    """Start one stream per prompt; once each has `min_chunks` chunks (or, with
    `allow_finished`, has finished), call fault(results) (in a thread, it may block); return
    the finished results."""
    results = [StreamResult() for _ in batch]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        tasks = [asyncio.create_task(stream_completion(s, base, p, max_tokens, ids[i] if ids else None, out=r))
                 for i, (p, r) in enumerate(zip(batch, results, strict=True))]
        while not all(r.chunks >= min_chunks or (allow_finished and t.done())
                      for r, t in zip(results, tasks, strict=True)):
            if not allow_finished and any(t.done() for t in tasks):
                raise AssertionError(f"a stream ended before the fault: {[t.result() for t in tasks if t.done()]}")
            await asyncio.sleep(0.005)
        await asyncio.to_thread(fault, results)
        await asyncio.gather(*tasks)
    return results


def kill_busiest_decode(cluster, results: list[StreamResult], victim: dict) -> None:
    """Kill the decode worker holding the most open streams. Every decode worker is frozen
    first and the client given a moment for what was already sent, so the streams still open
    are exactly those that must migrate. Freezing only the busiest-looking one was not enough:
    on a loaded machine the client fell a second behind and that worker had finished all its
    streams by the look (the other one is thawed after the kill)."""
    frozen = cluster.live(cluster.decode)
    for proc in frozen.values():
        proc.freeze()
    try:
        time.sleep(0.5)
        on = {}
        for r in results:
            on.setdefault(r.decode_worker, []).append(r)
        name = max(on, key=lambda w: sum(not r.done for r in on[w]))
        victim.update(name=name, streams=sum(not r.done for r in on[name]), spread=sorted(on))
        cluster.decode[name].kill()
    finally:
        for proc in frozen.values():
            proc.thaw()  # a no-op for the killed one


def replace_victim(cluster, victim: dict) -> None:
    """The Deployment's replacement pod; run even when the test failed, so the next tests
    meet the cluster they expect (2 decode + 1 prefill)."""
    if victim.get("name") in cluster.decode and cluster.decode[victim["name"]].proc.poll() is not None:
        cluster.decode.pop(victim["name"])
        cluster.start_decode(victim["name"])
        cluster.wait_registered(cluster.router)


def decode_metric(cluster, name: str, **labels) -> float:
    return sum(metric(p.match.group(3), name, **labels) for p in cluster.live(cluster.decode).values())


def test_kv_chunks_corrupted_or_dropped(cluster, reference):
    """corrupt_once: the checksum catches it, the push is retried and succeeds remotely.
    corrupt_always / drop: the transfer fails, the decode worker prefills locally."""
    base = cluster.router.base_url
    for n, fault in enumerate(["corrupt_once", "corrupt_always", "drop"]):
        batch = prompts(100 + n, 4, 90)  # >= 24 uncached tokens: disaggregated
        expected = reference(batch, 16)

        async def go(batch=batch, fault=fault):
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(complete(s, base, p, 16, f"{fault}-{i}", fault=fault) for i, p in enumerate(batch)))

        for i, ((status, body, headers), (_, text)) in enumerate(zip(asyncio.run(go()), expected, strict=True)):
            assert status == 200 and body["choices"][0]["text"] == text, (fault, i, body)
            who = served_by(headers)
            if fault == "corrupt_once":
                assert who["prefill"] == "prefill-0", (fault, who)
            else:
                assert who["prefill"] == who["decode"], (fault, who)  # local fallback
        cluster.wait_all_blocks_free()
    prefill_metrics = cluster.prefill["prefill-0"].match.group(2)
    assert metric(prefill_metrics, "splitserve_kv_transfer_errors_total", reason="checksum_mismatch") >= 4
    assert decode_metric(cluster, "splitserve_local_prefill_fallbacks_total") >= 8


def test_decode_worker_killed_during_16_concurrent_streams(cluster, reference):
    base = cluster.router.base_url
    batch = prompts(1, 16, 20)  # short prompts: the decode workers prefill them
    expected = reference(batch, MAX)
    migrations = metric(base, "splitserve_request_migrations_total")
    victim = {}
    try:
        results = asyncio.run(streams_with_fault(base, batch, MAX,
                                                 lambda res: kill_busiest_decode(cluster, res, victim)))
        assert_identical(results, expected, MAX)
        assert len(victim["spread"]) == 2, victim  # both workers had streams when one died
        # every open stream of the dead worker moved exactly once; none lost or restarted from scratch
        assert metric(base, "splitserve_request_migrations_total") - migrations == victim["streams"] >= 1, victim
    finally:
        replace_victim(cluster, victim)
    cluster.wait_all_blocks_free()


def test_decode_worker_killed_under_a_stream_interval(cluster, reference):
    """A router with --stream-interval 5: a decode worker dies holding tokens it has not sent
    yet; its streams resume from the tokens the router has, with no token lost or doubled."""
    router = cluster.start_router(["--stream-interval", "5"])
    cluster.wait_registered(router)
    batch = prompts(4, 8, 20)
    expected = reference(batch, MAX)
    migrations = metric(router.base_url, "splitserve_request_migrations_total")
    victim = {}
    try:
        results = asyncio.run(streams_with_fault(router.base_url, batch, MAX,
                                                 lambda res: kill_busiest_decode(cluster, res, victim), min_chunks=3))
        assert_identical(results, expected, MAX)
        # grouped: a first chunk, then about MAX / 5 (more where a migration restarted the count)
        assert all(r.chunks < MAX // 2 for r in results), [r.chunks for r in results]
        assert metric(router.base_url, "splitserve_request_migrations_total") - migrations == victim["streams"] >= 1
    finally:
        replace_victim(cluster, victim)
        router.stop()
        cluster.routers.remove(router)
    cluster.wait_all_blocks_free()


def test_prefill_worker_killed_during_prefills(cluster, reference):
    """The prefill worker dies holding computed KV that it has not pushed yet (`slow-`
    requests wait 2 s before pushing): the decode workers prefill locally."""
    base = cluster.router.base_url
    batch = prompts(2, 8, 90)
    expected = reference(batch, 24)
    fallbacks = decode_metric(cluster, "splitserve_local_prefill_fallbacks_total")
    health = cluster.prefill["prefill-0"].match.group(2) + "/health"

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            tasks = [asyncio.create_task(stream_completion(s, base, p, 24, f"slow-{i}", fault="slow")) for i, p in enumerate(batch)]
            await asyncio.to_thread(wait_for, lambda: requests.get(health, timeout=5).json()["kv"]["held_for_push"],
                                    30, "prefills holding KV for their push")
            cluster.prefill["prefill-0"].kill()
            return await asyncio.gather(*tasks)

    assert_identical(asyncio.run(go()), expected, 24)
    assert decode_metric(cluster, "splitserve_local_prefill_fallbacks_total") - fallbacks >= 1
    cluster.prefill.pop("prefill-0")
    cluster.start_prefill("prefill-0", FAULTY_PREFILL)
    cluster.wait_registered(cluster.router)
    cluster.wait_all_blocks_free()


def test_redis_restart_routers_keep_serving_and_resync(cluster, reference):
    base = cluster.router.base_url
    warm = prompts(3, 1, 100)[0]
    status, _, headers = asyncio.run(_one(base, warm))
    home = served_by(headers)["decode"]
    batch = prompts(4, 16, 20)
    expected = reference(batch, MAX)
    seen: list[int] = []  # decode workers the router listed, sampled through the outage
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(len(requests.get(base + "/health", timeout=5).json()["decode_workers"]))
            stop.wait(0.1)

    during: list = []

    def restart_redis(_results):
        cluster.kill_redis()
        # requests keep coming while the bus is gone: routed on the last known state
        during.extend(asyncio.run(_many(base, prompts(5, 4, 20), MAX // 4)))
        cluster.start_redis()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = asyncio.run(streams_with_fault(base, batch, MAX, restart_redis))
        after = asyncio.run(_many(base, prompts(6, 8, 20), 16))  # right after Redis came back
        # the workers registered again in the new Redis, and the router never lost them
        client = redis.Redis(host="127.0.0.1", port=cluster.redis_port)
        wait_for(lambda: len(client.keys("splitserve:local:workers:*")) == 3, 10, "workers re-registered in Redis")
        client.close()
    finally:
        stop.set()
        watcher.join()
    assert_identical(results, expected, MAX)
    assert_identical(during, reference(prompts(5, 4, 20), MAX // 4), MAX // 4)
    assert_identical(after, reference(prompts(6, 8, 20), 16), 16)
    assert min(seen) == 2, seen
    # The worker republished its cache into the new Redis after re-registering; wait until the
    # router applied it (the count of home's blocks it knows stops moving) before asking.
    since: dict[float, float] = {}  # count -> when it was first seen in a row

    def settled() -> bool:
        count, now = metric(base, "splitserve_router_index_worker_blocks", worker=home), time.monotonic()
        if count not in since:
            since.clear()
            since[count] = now
        return count >= 6 and now - since[count] >= 1.5  # warm's 6 blocks at least, unchanged for 1.5 s

    wait_for(settled, 20, f"the router's index holding {home}'s republished blocks")
    # the index survived: the prompt cached before the restart still goes home, as a cache hit
    _, body, headers = asyncio.run(_one(base, warm))
    assert served_by(headers)["decode"] == home and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96, \
        (home, headers["X-Splitserve-Workers"])
    cluster.wait_all_blocks_free()


def test_router_killed_mid_stream_workers_free_blocks_and_index_is_rebuilt(cluster, reference):
    old = cluster.router
    warm = prompts(7, 1, 100)[0]
    _, _, headers = asyncio.run(_one(old.base_url, warm))
    home = served_by(headers)["decode"]
    batch = prompts(8, 16, 20)
    try:
        # streams that finish first are fine here: the point is what the workers do after
        asyncio.run(streams_with_fault(old.base_url, batch, MAX, lambda _r: old.kill(), allow_finished=True))
        raise AssertionError("the streams survived their router's death")
    except aiohttp.ClientError:
        pass  # those clients lost their connection: they retry (below)
    # the workers saw their router go away: every stream aborted, every block free
    cluster.wait_all_blocks_free()
    cluster.routers.remove(old)
    cluster.router = cluster.start_router()
    health = cluster.wait_registered(cluster.router)
    assert health["index"]["per_worker"].get(home, 0) > 0  # rebuilt from the workers' KV event streams
    _, body, headers = asyncio.run(_one(cluster.router.base_url, warm))
    assert served_by(headers)["decode"] == home and body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    assert_identical(asyncio.run(_many(cluster.router.base_url, batch, MAX)), reference(batch, MAX), MAX)
    cluster.wait_all_blocks_free()


async def _one(base: str, prompt: list[int]):
    async with aiohttp.ClientSession() as s:
        return await complete(s, base, prompt, 4)


async def _many(base: str, batch: list[list[int]], max_tokens: int) -> list[StreamResult]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        return await asyncio.gather(*(stream_completion(s, base, p, max_tokens) for p in batch))
