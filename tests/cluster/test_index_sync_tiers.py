"""IndexSync and KV events that carry a tier: a worker's host/disk blocks land under its
tier holder, a `cleared` or a departure forgets them too; on Redis and in-process."""

import random

from splitserve.cluster.messages import KVEvent, LoadReport, decode, encode
from splitserve.router.index_sync import IndexSync
from splitserve.router.policy import route
from splitserve.router.radix_index import RadixIndex
from splitserve.router.tier_scoring import tier_holder
from tests.cluster.test_index_sync import BS, Publisher, hashes

PROMPT = hashes(list(range(40)))  # 10 blocks


class TierPublisher(Publisher):
    async def publish_tier(self, kind, hs, tier):
        ev = KVEvent(self.worker_id, self.next_id, kind, list(hs), None, tier=tier)
        self.next_id += 1
        self.sent.append(ev)
        await self.bus.publish_kv(ev)


def test_kv_event_tier_survives_encoding_and_defaults_to_device():
    ev = KVEvent("w", 1, "stored", [1, 2], None, tier="disk")
    assert decode(KVEvent, encode(ev)).tier == "disk"
    old = {k: v for k, v in ev.__dict__.items() if k != "tier"}  # a worker from before tiers
    assert KVEvent(**old).tier == "device"


async def test_tier_events_score_the_worker_and_leave_with_it(bus_factory):
    bus = bus_factory()
    d1, d2 = TierPublisher(bus, "d1"), TierPublisher(bus, "d2")
    for w in (d1, d2):
        await w.register()
    await d1.publish_tier("stored", PROMPT, "host")  # d1 had the prompt, now only in its host tier
    await d2.publish("stored", PROMPT[:2])  # d2 holds 2 blocks on device
    sync = IndexSync(bus_factory(), RadixIndex())
    await sync.catch_up()
    matched = sync.index.match(PROMPT)
    assert matched == {"d1@offload": 10, "d2": 2}
    loads = {w: LoadReport(w, "decode", 0, 0, 0.0) for w in ("d1", "d2")}
    assert route(41, BS, matched, sync.live("decode"), [], loads, random.Random(0)).decode_worker == "d1"

    await d1.publish_tier("removed", PROMPT[5:], "disk")  # dropped from its disk tier
    await sync.poll()
    assert sync.index.match(PROMPT)[tier_holder("d1")] == 5
    await d1.publish("cleared")  # a restart: its tiers are new too
    await sync.poll()
    assert sync.index.match(PROMPT) == {"d2": 2}
    await d2.publish_tier("stored", PROMPT, "disk")
    await sync.poll()
    await sync._resync("d2")  # a resync forgets the tier holder and replays it from the stream
    await sync.poll()
    assert sync.index.match(PROMPT) == {"d2": 2, "d2@offload": 10}
