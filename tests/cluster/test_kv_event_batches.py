"""KV events published in batches: one bus call (one Redis round trip, one bridge RPC) for
what a worker queued, in order, ids intact; a bad batch through the bridge applies nothing."""

from __future__ import annotations

import asyncio

import grpc
import msgpack
import pytest

from splitserve.cluster.bus import START, BusError
from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo, encode
from splitserve.cluster.presence import PUBLISH_BATCH, WorkerPresence
from splitserve.cluster.remote_bus import MAX_KV_BATCH, BusServicer, RemoteBus
from splitserve.core.block_events import BlockEvent
from splitserve.proto.worker_pb2_grpc import add_BusServicer_to_server


def events(worker_id: str, first: int, n: int) -> list[KVEvent]:
    return [KVEvent(worker_id, i, "stored", [i, i + 1], None, timestamp=1.0) for i in range(first, first + n)]


async def test_a_batch_lands_in_order_and_returns_the_last_position(bus):
    batch = events("d1", 1, 5)
    last = await bus.publish_kv_batch(batch)
    await bus.publish_kv(events("d1", 6, 1)[0])
    records = await bus.read_kv({"d1": START})
    assert [r.event for r in records] == [*batch, *events("d1", 6, 1)]
    assert records[4].position == last
    assert await bus.publish_kv_batch([]) is None


@pytest.fixture
async def bridge():
    """The embedded bus bridge on 127.0.0.1, an InProcBus behind it, a RemoteBus in front."""
    inner = InProcBus("bridge-test")
    server = grpc.aio.server()
    add_BusServicer_to_server(BusServicer(inner, model="demo", block_size=16), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    remote = RemoteBus(f"127.0.0.1:{port}")
    yield inner, remote
    await remote.close()
    await server.stop(None)


async def test_the_bridge_applies_a_batch_in_one_call(bridge):
    inner, remote = bridge
    batch = events("d1", 1, 40)
    await remote.publish_kv_batch(batch)
    assert [r.event for r in await inner.read_kv({"d1": START})] == batch


async def test_a_bad_event_anywhere_in_a_batch_applies_none_of_it(bridge):
    inner, remote = bridge
    good = [encode(e) for e in events("d1", 1, 3)]
    bad = encode(KVEvent("d1", 4, "exploded", [1], None))
    with pytest.raises(BusError, match="INVALID_ARGUMENT.*exploded"):
        await remote._call("publish_kv_batch", msgpack.packb([*good, bad], use_bin_type=True))
    with pytest.raises(BusError, match=f"INVALID_ARGUMENT.*1 to {MAX_KV_BATCH} events"):
        await remote.publish_kv_batch(events("d1", 1, MAX_KV_BATCH + 1))
    with pytest.raises(BusError, match="INVALID_ARGUMENT.*encoded events"):
        await remote._call("publish_kv_batch", msgpack.packb([1, 2]))
    assert await inner.read_kv({"d1": START}) == []


class CountingBus(InProcBus):
    def __init__(self):
        super().__init__("count")
        self.calls: list[int] = []

    async def publish_kv_batch(self, batch, maxlen=10_000):
        self.calls.append(len(batch))
        return await super().publish_kv_batch(batch, maxlen)


async def test_a_worker_publishes_what_it_queued_in_one_call_with_ids_in_order():
    bus = CountingBus()
    info = WorkerInfo("d1", "decode", "127.0.0.1:1", "demo", 16, 64)
    presence = WorkerPresence(bus, info, lambda: LoadReport("d1", "decode", 0, 0, 0.0))
    await presence.start()  # queues `cleared`; its publisher runs at the next await
    presence.publish_block_events([BlockEvent("stored", [h]) for h in range(300)])  # a big step
    for _ in range(100):
        if sum(bus.calls) == 301:
            break
        await asyncio.sleep(0.01)
    got = [r.event for r in await bus.read_kv({"d1": START})]
    await presence.stop()
    assert bus.calls == [PUBLISH_BATCH, 301 - PUBLISH_BATCH]
    assert [e.event_id for e in got] == list(range(1, 302))
    assert got[0].kind == "cleared" and [e.block_hashes for e in got[1:]] == [[h] for h in range(300)]
