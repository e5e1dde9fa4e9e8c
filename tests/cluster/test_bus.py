"""One suite, two buses: every test runs on a real redis-server and on InProcBus."""

import asyncio

import pytest
import redis.asyncio as aioredis

from splitserve.cluster.bus import START, BusError, parse_position
from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo
from splitserve.cluster.redis_bus import RedisBus


def info(worker_id, role="decode"):
    return WorkerInfo(worker_id, role, f"10.0.0.1:{50000 + len(worker_id)}", "demo", 16, 1024,
                      started_at=1700000000.0)


def event(worker_id, event_id, kind="stored", hashes=(1, 2), parent=None):
    return KVEvent(worker_id, event_id, kind, list(hashes), parent, timestamp=1700000001.0)


async def test_register_list_deregister(bus):
    await bus.register(info("d1"), ttl=30)
    await bus.register(info("p1", "prefill"), ttl=30)
    assert await bus.live_workers() == {"d1": info("d1"), "p1": info("p1", "prefill")}
    await bus.publish_kv(event("d1", 1))
    await bus.publish_load(LoadReport("d1", "decode", 1, 2, 0.5, timestamp=1.0), ttl=30)
    await bus.deregister("d1")
    assert list(await bus.live_workers()) == ["p1"]
    assert await bus.loads() == {}
    assert await bus.read_kv({"d1": START}) == []  # its stream went with it


async def test_heartbeat_expiry_and_return(bus):
    await bus.register(info("d1"), ttl=0.3)
    assert await bus.heartbeat(info("d1"), ttl=0.3) is True
    await asyncio.sleep(0.5)
    assert await bus.live_workers() == {}  # missed its heartbeat: gone
    assert await bus.heartbeat(info("d1"), ttl=30) is False  # comes back, and is told so
    assert list(await bus.live_workers()) == ["d1"]


async def test_load_reports_latest_and_expiring(bus):
    await bus.publish_load(LoadReport("d1", "decode", 1, 2, 0.25, timestamp=1.0), ttl=30)
    await bus.publish_load(LoadReport("d1", "decode", 3, 4, 0.5, 100, timestamp=2.0), ttl=30)
    await bus.publish_load(LoadReport("p1", "prefill", 0, 0, 0.0, 7, timestamp=2.0), ttl=0.2)
    assert (await bus.loads())["d1"] == LoadReport("d1", "decode", 3, 4, 0.5, 100, 2.0)
    await asyncio.sleep(0.4)
    assert list(await bus.loads()) == ["d1"]


async def test_kv_streams_replay_in_order_per_worker(bus):
    positions = []
    for i in range(1, 6):
        positions.append(await bus.publish_kv(event("d1", i, hashes=[i])))
        await bus.publish_kv(event("d2", i, hashes=[100 + i]))
    assert [parse_position(p) for p in positions] == sorted(parse_position(p) for p in positions)
    records = await bus.read_kv({"d1": START, "d2": START})
    for w, base in (("d1", 0), ("d2", 100)):
        mine = [r for r in records if r.worker_id == w]
        assert [r.event.event_id for r in mine] == [1, 2, 3, 4, 5]
        assert [r.event.block_hashes for r in mine] == [[base + i] for i in range(1, 6)]
    assert [r.position for r in records if r.worker_id == "d1"] == positions
    newer = await bus.read_kv({"d1": positions[2]})
    assert [r.event.event_id for r in newer] == [4, 5]
    assert await bus.kv_tail("d1") == positions[-1]
    assert await bus.kv_tail("nobody") == START
    assert await bus.read_kv({"nobody": START}) == []
    assert len(await bus.read_kv({"d1": START}, count=2)) == 2


async def test_events_round_trip_exactly(bus):
    big = KVEvent("d1", 7, "stored", [2**64 - 1, 0, 12345], parent=2**63, timestamp=5.5)
    await bus.publish_kv(big)
    await bus.publish_kv(KVEvent("d1", 8, "cleared", [], None, timestamp=6.0))
    got = [r.event for r in await bus.read_kv({"d1": START})]
    assert got == [big, KVEvent("d1", 8, "cleared", [], None, timestamp=6.0)]


async def test_streams_are_trimmed_to_about_maxlen(bus):
    for i in range(1, 501):
        await bus.publish_kv(event("d1", i), maxlen=100)
    ids = [r.event.event_id for r in await bus.read_kv({"d1": START}, count=10_000)]
    assert 100 <= len(ids) <= 200  # "about": at least maxlen, whole chunks dropped
    assert ids == list(range(501 - len(ids), 501))  # the newest, contiguous


async def test_blocking_read_wakes_on_publish_and_times_out_empty(bus_factory):
    reader, writer = bus_factory(), bus_factory()
    assert await reader.read_kv({"d1": START}, block=0.2) == []
    assert await reader.read_kv({}, block=0.1) == []
    waiting = asyncio.create_task(reader.read_kv({"d1": START}, block=5))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await writer.publish_kv(event("d1", 1))
    records = await asyncio.wait_for(waiting, timeout=3)
    assert [r.event.event_id for r in records] == [1]


async def test_redis_layout_matches_messages_module(redis_url):
    bus = RedisBus(redis_url, cluster="layout")
    raw = aioredis.Redis.from_url(redis_url)
    try:
        await bus.register(info("d1"), ttl=30)
        await bus.publish_load(LoadReport("d1", "decode", 0, 0, 0.0), ttl=30)
        await bus.publish_kv(event("d1", 1))
        keys = sorted(k.decode() for k in await raw.keys("splitserve:layout:*"))
        assert keys == ["splitserve:layout:kv:d1", "splitserve:layout:load:d1",
                        "splitserve:layout:workers:d1"]
        assert 0 < await raw.pttl("splitserve:layout:workers:d1") <= 30_000
        assert await raw.type("splitserve:layout:kv:d1") == b"stream"
        # a corrupt entry is skipped with a log line, not a crash
        await raw.xadd("splitserve:layout:kv:d1", {"m": b"\xc1garbage"})
        assert [r.event.event_id for r in await bus.read_kv({"d1": START})] == [1]
    finally:
        await raw.delete(*await raw.keys("splitserve:layout:*"))
        await raw.aclose()
        await bus.close()


async def test_unreachable_redis_is_a_clear_bus_error():
    bus = RedisBus("redis://127.0.0.1:1/0")
    with pytest.raises(BusError, match=r"Redis at redis://127.0.0.1:1/0 failed to list the workers entries"):
        await bus.live_workers()
    await bus.close()
    with pytest.raises(BusError, match="invalid Redis URL"):
        RedisBus("http://nope")
