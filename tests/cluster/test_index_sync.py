"""IndexSync: routers rebuild, agree, resync on gaps and forget dead workers — on Redis
and on the in-process bus."""

import asyncio
import random

from splitserve.cluster.bus import BusError
from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo
from splitserve.core.hashing import block_hashes, hash_seed
from splitserve.metrics import Metrics
from splitserve.router.index_sync import IndexSync
from splitserve.router.policy import route
from splitserve.router.radix_index import RadixIndex

BS = 4
SEED = hash_seed("demo")


def hashes(tokens):
    return block_hashes(tokens, BS, SEED)


class Publisher:
    """Publishes a worker's KV events the way workers must: ids 1, 2, 3..."""

    def __init__(self, bus, worker_id, role="decode"):
        self.bus, self.worker_id, self.role = bus, worker_id, role
        self.next_id = 1
        self.sent: list[KVEvent] = []

    async def register(self, ttl=30.0):
        await self.bus.register(WorkerInfo(self.worker_id, self.role, "127.0.0.1:1", "demo",
                                           BS, 64), ttl)

    async def publish(self, kind, hs=(), parent=None, event_id=None):
        ev = KVEvent(self.worker_id, event_id or self.next_id, kind, list(hs), parent)
        self.next_id = ev.event_id + 1
        self.sent.append(ev)
        await self.bus.publish_kv(ev)


def reference(events) -> RadixIndex:
    """What the index must hold after these events, applied directly."""
    idx = RadixIndex()
    for ev in events:
        if ev.kind == "stored":
            idx.apply_stored(ev.worker_id, ev.parent, ev.block_hashes)
        elif ev.kind == "removed":
            idx.apply_removed(ev.worker_id, ev.block_hashes)
        else:
            idx.clear_worker(ev.worker_id)
    return idx


PROMPTS = [hashes([i % 7] * 8 + list(range(i, i + 24))) for i in range(6)]


async def publish_history(bus):
    workers = [Publisher(bus, "d1"), Publisher(bus, "d2"), Publisher(bus, "p1", "prefill")]
    for w in workers:
        await w.register()
    rng = random.Random(5)
    for _ in range(30):
        w = rng.choice(workers)
        p = rng.choice(PROMPTS)
        k = rng.randrange(1, len(p) + 1)
        if rng.random() < 0.7:
            await w.publish("stored", p[:k])
        else:
            await w.publish("removed", p[k - 1:])
    await workers[1].publish("cleared")
    await workers[1].publish("stored", PROMPTS[0][:3])
    return workers


def all_events(workers):
    return [ev for w in workers for ev in w.sent]


async def test_router_started_after_the_events_rebuilds_the_same_index(bus_factory):
    workers = await publish_history(bus_factory())
    sync = IndexSync(bus_factory(), RadixIndex())
    applied = await sync.catch_up()
    assert applied == len(all_events(workers))
    assert sync.index.snapshot() == reference(all_events(workers)).snapshot()
    assert sync.index.snapshot()  # not trivially empty
    assert sorted(sync.workers) == ["d1", "d2", "p1"]
    assert sync.live("prefill") == ["p1"] and sync.mode("d1") == "precise"


async def test_two_routers_build_identical_indexes_and_choose_alike(bus_factory):
    workers = await publish_history(bus_factory())
    a, b = IndexSync(bus_factory(), RadixIndex()), IndexSync(bus_factory(), RadixIndex())
    await a.catch_up()
    await workers[0].publish("stored", PROMPTS[4])  # arrives after a, before b starts
    await b.catch_up()
    await a.poll()
    assert a.index.snapshot() == b.index.snapshot()
    loads = {"d1": LoadReport("d1", "decode", 0, 3, 0.2), "d2": LoadReport("d2", "decode", 0, 3, 0.2)}
    for seed, prompt in enumerate(PROMPTS):
        tokens = len(prompt) * BS
        da = route(tokens, BS, a.index.match(prompt), a.live("decode"), a.live("prefill"), loads,
                   random.Random(seed))
        db = route(tokens, BS, b.index.match(prompt), b.live("decode"), b.live("prefill"), loads,
                   random.Random(seed))
        assert da == db


async def test_event_id_gap_resyncs_that_worker_from_its_stream(bus_factory):
    d1, d2 = Publisher(bus_factory(), "d1"), Publisher(bus_factory(), "d2")
    await d1.register()
    await d2.register()
    for i in range(3):
        await d1.publish("stored", PROMPTS[i])
    await d2.publish("stored", PROMPTS[5])
    metrics = Metrics()
    sync = IndexSync(bus_factory(), RadixIndex(), metrics=metrics)
    await sync.catch_up()
    sync.index.apply_stored("d1", None, [424242])  # the router's view went wrong somehow
    await d1.publish("removed", PROMPTS[0][-2:], event_id=5)  # event 4 never arrived
    assert await sync.poll() == 0  # gap seen: nothing applied, d1 cleared and rewound
    assert sync.workers["d1"].resyncs == 1 and sync.index.blocks_of("d1") == 0
    assert sync.index.blocks_of("d2") == len(PROMPTS[5])  # other workers untouched
    await sync.poll()  # the replay, which tolerates the hole it contains
    assert 424242 not in sync.index
    assert sync.index.snapshot() == reference(d1.sent + d2.sent).snapshot()
    await d1.publish("stored", PROMPTS[3])  # event 6 follows normally
    await sync.poll()
    assert sync.workers["d1"].resyncs == 1
    assert sync.index.snapshot() == reference(d1.sent + d2.sent).snapshot()
    assert metrics.router_index_resyncs.labels(worker="d1")._value.get() == 1
    assert metrics.router_index_blocks._value.get() == sync.index.num_blocks


async def test_restarted_worker_starts_with_cleared_and_is_not_a_gap(bus_factory):
    d1 = Publisher(bus_factory(), "d1")
    await d1.register()
    await d1.publish("stored", PROMPTS[0])
    await d1.publish("stored", PROMPTS[1])
    sync = IndexSync(bus_factory(), RadixIndex())
    await sync.catch_up()
    await d1.publish("cleared", event_id=1)  # new process, fresh cache, ids from 1
    await d1.publish("stored", PROMPTS[2])
    await sync.poll()
    assert sync.workers["d1"].resyncs == 0
    assert sync.index.match(PROMPTS[2]) == {"d1": len(PROMPTS[2])}
    assert sync.index.match(PROMPTS[0]) == {}


async def test_worker_restarted_at_a_new_address_is_dialled_there_and_logged(bus_factory, caplog):
    """A replacement process under the same id re-registers before the old registration
    expires: the router's next refresh takes the new address and says so once."""
    bus = bus_factory()
    await bus.register(WorkerInfo("d1", "decode", "127.0.0.1:1", "demo", BS, 64, started_at=100.0), 30)
    sync = IndexSync(bus_factory(), RadixIndex())
    await sync.catch_up()
    await bus.register(WorkerInfo("d1", "decode", "127.0.0.1:2", "demo", BS, 64, started_at=200.0), 30)
    with caplog.at_level("INFO", logger="splitserve.router.index_sync"):
        await sync.refresh()
        await sync.refresh()
    assert sync.workers["d1"].info.address == "127.0.0.1:2"
    restarts = [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()]
    assert restarts == ["worker d1 (decode) restarted: now at 127.0.0.1:2 (was 127.0.0.1:1)"]


async def test_heartbeat_expiry_removes_the_worker_and_return_replays_it(bus_factory):
    d1, d2 = Publisher(bus_factory(), "d1"), Publisher(bus_factory(), "d2")
    await d1.register(ttl=0.4)
    await d2.register(ttl=30)
    await d1.publish("stored", PROMPTS[0])
    await d2.publish("stored", PROMPTS[0][:2])
    metrics = Metrics()
    sync = IndexSync(bus_factory(), RadixIndex(), metrics=metrics)
    await sync.catch_up()
    assert sync.index.match(PROMPTS[0]) == {"d1": len(PROMPTS[0]), "d2": 2}
    assert metrics.workers_healthy.labels(role="decode")._value.get() == 2
    known = {s.labels["worker"]: s.value for s in metrics.router_index_worker_blocks.collect()[0].samples}
    assert known == {"d1": len(PROMPTS[0]), "d2": 2}
    await asyncio.sleep(0.6)  # d1 misses its heartbeat
    await sync.refresh()
    assert sync.live("decode") == ["d2"] and sync.index.blocks_of("d1") == 0
    assert sync.index.match(PROMPTS[0]) == {"d2": 2}
    assert metrics.workers_healthy.labels(role="decode")._value.get() == 1
    # the departed worker's series goes with it (no stale count for a worker that is gone)
    assert [s.labels["worker"] for s in metrics.router_index_worker_blocks.collect()[0].samples] == ["d2"]
    await d1.register(ttl=30)  # back (same process, cache intact): its stream is replayed
    await sync.catch_up()
    assert sync.index.match(PROMPTS[0]) == {"d1": len(PROMPTS[0]), "d2": 2}


async def test_workers_without_events_use_ttl_approximate_entries(bus_factory):
    d1 = Publisher(bus_factory(), "d1")
    await d1.register()
    sync = IndexSync(bus_factory(), RadixIndex(), approx_ttl=0.3)
    await sync.catch_up()
    assert sync.mode("d1") == "approximate"
    sync.record_routed("d1", PROMPTS[0])
    assert sync.index.match(PROMPTS[0]) == {"d1": len(PROMPTS[0])}
    await asyncio.sleep(0.4)
    assert sync.index.match(PROMPTS[0]) == {}  # the guess expired
    sync.record_routed("d1", PROMPTS[1])
    await d1.publish("stored", PROMPTS[2][:2])  # d1 starts reporting for itself
    await sync.poll()
    assert sync.mode("d1") == "precise"
    assert sync.index.match(PROMPTS[1]) == {}  # guesses dropped in favour of the reports
    sync.record_routed("d1", PROMPTS[1])  # and no longer recorded
    assert sync.index.match(PROMPTS[1]) == {}
    assert sync.index.match(PROMPTS[2]) == {"d1": 2}


async def test_background_loop_follows_workers_that_join_later(bus_factory):
    sync = IndexSync(bus_factory(), RadixIndex(), refresh_interval=0.1, read_block=0.1)
    task = asyncio.create_task(sync.run())
    try:
        d1 = Publisher(bus_factory(), "d1")
        await d1.register()
        await d1.publish("stored", PROMPTS[0])
        await d1.bus.publish_load(LoadReport("d1", "decode", 2, 5, 0.5), ttl=30)
        for _ in range(100):
            if sync.index.match(PROMPTS[0]) and "d1" in sync.loads:
                break
            await asyncio.sleep(0.05)
        assert sync.index.match(PROMPTS[0]) == {"d1": len(PROMPTS[0])}
        assert sync.loads["d1"].running == 5
    finally:
        sync.stop()
        await asyncio.wait_for(task, timeout=3)


async def test_background_loop_survives_a_bus_outage(bus_factory, caplog):
    bus = bus_factory()
    sync = IndexSync(bus, RadixIndex(), refresh_interval=0.05, read_block=0.05)
    real_live_workers = bus.live_workers
    calls = 0

    async def flaky():
        nonlocal calls
        calls += 1
        if calls <= 2:  # injected failure: the first two registry reads fail
            raise BusError("Redis at redis://x failed to list the workers entries: down")
        return await real_live_workers()

    bus.live_workers = flaky
    d1 = Publisher(bus_factory(), "d1")
    await d1.register()
    await d1.publish("stored", PROMPTS[0])
    task = asyncio.create_task(sync.run())
    try:
        for _ in range(100):
            if sync.index.match(PROMPTS[0]):
                break
            await asyncio.sleep(0.05)
        assert sync.index.match(PROMPTS[0]) == {"d1": len(PROMPTS[0])}
        assert "routing continues on the last known state" in caplog.text
    finally:
        sync.stop()
        await asyncio.wait_for(task, timeout=3)
        bus.live_workers = real_live_workers


async def test_workers_of_another_model_or_block_size_are_refused_and_counted(bus_factory, caplog):
    """Cluster mode (Redis): nothing checks at registration, so the router does. A worker
    with another block size would miss every prefix lookup; one with another model would
    answer with the wrong model."""
    bus = bus_factory()
    good = Publisher(bus, "d-good")
    await good.register()
    await bus.register(WorkerInfo("d-blocks", "decode", "127.0.0.1:2", "demo", 2 * BS, 64), 30.0)
    await bus.register(WorkerInfo("d-model", "decode", "127.0.0.1:3", "other-model", BS, 64), 30.0)
    metrics = Metrics()
    sync = IndexSync(bus, RadixIndex(), metrics=metrics, model="demo", block_size=BS)
    for _ in range(3):  # refused on every refresh, logged and counted once per registration
        await sync.refresh()
    assert sync.live("decode") == ["d-good"]
    assert set(sync.refused) == {"d-blocks", "d-model"}
    count = metrics.worker_registrations_refused.labels
    assert count(reason="block_size_mismatch")._value.get() == 1 and count(reason="model_mismatch")._value.get() == 1
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 2 and any("--block-size" in m for m in refusals), refusals
