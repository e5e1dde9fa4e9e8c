"""A worker leaves the registry when it is unhealthy, not when one check failed: a health
check that timed out during a CPU stall passes a moment later, and withdrawing a healthy
worker would move its streams and send it nothing for seconds."""

from __future__ import annotations

import asyncio

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.cluster.messages import LoadReport, WorkerInfo
from splitserve.cluster.presence import WorkerPresence


class RecordingBus(InProcBus):
    def __init__(self):
        super().__init__("presence-health")
        self.deregistered: list[str] = []

    async def deregister(self, worker_id: str) -> None:
        self.deregistered.append(worker_id)
        await super().deregister(worker_id)


def presence_with(bus, answers: list[str]) -> tuple[WorkerPresence, list[str]]:
    """A presence whose health checks answer from `answers` in turn ("" = healthy), then healthy."""
    asked: list[str] = []

    async def healthy() -> str:
        why = answers.pop(0) if answers else ""
        asked.append(why)
        return why

    info = WorkerInfo("d1", "decode", "127.0.0.1:1", "demo", 16, 64)
    return WorkerPresence(bus, info, lambda: LoadReport("d1", "decode", 0, 0, 0.0), ttl=0.3,
                          healthy=healthy, recheck_s=0.05), asked


async def wait_for(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_one_failed_check_that_passes_on_recheck_keeps_the_worker_registered(caplog):
    bus = RecordingBus()
    presence, asked = presence_with(bus, ["grpc_unhealthy: own gRPC server: DEADLINE_EXCEEDED"])
    await presence.start()
    try:
        await wait_for(lambda: len(asked) >= 4)  # the failed check, its recheck, two more beats
        assert bus.deregistered == [] and not presence.withdrawn
        assert "d1" in await bus.live_workers()
        assert "passed on a recheck" in caplog.text and "DEADLINE_EXCEEDED" in caplog.text
    finally:
        await presence.stop()


async def test_a_failure_that_persists_withdraws_the_worker_until_it_recovers():
    bus = RecordingBus()
    presence, asked = presence_with(bus, ["engine_unhealthy: stalled"] * 3)
    await presence.start()
    try:
        await wait_for(lambda: presence.withdrawn)
        assert bus.deregistered == ["d1"] and "d1" not in await bus.live_workers()
        for _ in range(500):  # healthy again: registered again
            if "d1" in await bus.live_workers():
                break
            await asyncio.sleep(0.01)
        assert not presence.withdrawn and "d1" in await bus.live_workers()
    finally:
        await presence.stop()
