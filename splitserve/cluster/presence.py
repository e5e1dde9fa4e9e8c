"""Keeps one worker visible on the cluster bus: registration and heartbeat, periodic
load reports, and its KV events numbered 1, 2, 3... (event 1 is `cleared`, so a
router replaying an older stream of the same worker id drops what came before)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from splitserve.cluster.bus import BusError, ClusterBus
from splitserve.cluster.messages import KVEvent, LoadReport, WorkerInfo
from splitserve.core.block_events import BlockEvent

log = logging.getLogger(__name__)

PUBLISH_BATCH = 256  # KV events in one bus call, at most


class WorkerPresence:
    def __init__(self, bus: ClusterBus, info: WorkerInfo, load: Callable[[], LoadReport],
                 ttl: float = 6.0, load_interval: float = 0.5,
                 cached_blocks: Callable[[], Awaitable[list[int]]] | None = None,
                 healthy: Callable[[], Awaitable[str]] | None = None, recheck_s: float = 0.5):
        self.bus = bus
        self.info = info
        self.load = load
        self.cached_blocks = cached_blocks  # hashes in this worker's prefix cache now
        # "" when healthy, else why not (engine stalled or dead, own gRPC server not answering):
        # out of the registry until it recovers
        self.healthy = healthy or _always_healthy
        self.withdrawn = False  # left the registry because it was unhealthy
        # A failed check is asked again this much later before the worker leaves: a probe
        # that timed out while the CPU stalled passes once the stall is over.
        self.recheck_s = recheck_s
        self.ttl = ttl
        self.load_interval = load_interval
        self._next_event_id = 1
        self._events: asyncio.Queue[KVEvent] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self.visible = False

    async def start(self) -> None:
        self._queue_event("cleared", [], None)
        await self.bus.register(self.info, self.ttl)
        self.visible = True
        self._tasks = [asyncio.create_task(self._heartbeats(), name="heartbeat"),
                       asyncio.create_task(self._load_reports(), name="load-reports"),
                       asyncio.create_task(self._publish_events(), name="kv-events")]

    def publish_block_events(self, events: list[BlockEvent]) -> None:
        """Called on the event loop with the engine's block events of one step."""
        for e in events:
            self._queue_event(e.kind, e.block_hashes, e.parent, e.tier)

    def _queue_event(self, kind: str, hashes: list[int], parent: int | None, tier: str = "device") -> None:
        self._events.put_nowait(KVEvent(self.info.worker_id, self._next_event_id, kind, list(hashes), parent,
                                        tier=tier))
        self._next_event_id += 1

    async def _republish(self) -> None:
        """A lost registration may mean a restarted bus that lost our event history too:
        `cleared` then everything cached now, so any router (following, resyncing or new)
        can rebuild this worker's index entries from the stream alone."""
        if self.cached_blocks is None:
            return
        hashes = await self.cached_blocks()
        self._queue_event("cleared", [], None)
        for i in range(0, len(hashes), 512):
            # Parents are not tracked per cached block: each chunk is stored as a root; the
            # index matches chained hashes, which identify their whole prefix anyway.
            self._queue_event("stored", hashes[i:i + 512], None)

    async def announce_draining(self) -> None:
        """Still registered (its streams finish here), but routers send nothing new."""
        self.info.draining = True
        try:
            await self.bus.register(self.info, self.ttl)
        except BusError as exc:
            log.warning("worker %s: could not announce draining: %s", self.info.worker_id, exc)

    async def withdraw(self, why: str) -> None:
        """Leave the registry now, as a failed health check does, without waiting for the
        next heartbeat; the heartbeat loop registers again once the checks pass."""
        if self.withdrawn or not self.visible:
            return
        log.error("worker %s is unhealthy (%s): leaving the registry until it recovers", self.info.worker_id, why)
        self.withdrawn = True
        try:
            await self.bus.deregister(self.info.worker_id)
        except BusError as exc:
            log.warning("worker %s: could not deregister: %s", self.info.worker_id, exc)

    async def hide(self) -> None:
        """Leave the registry (draining): routers stop sending new requests here."""
        self.visible = False
        try:
            await self.bus.deregister(self.info.worker_id)
        except BusError as exc:
            log.warning("worker %s: could not deregister from the bus: %s", self.info.worker_id, exc)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.visible:
            await self.hide()

    async def _heartbeats(self) -> None:
        failing = False
        while True:
            # After a failure retry every 0.2 s: a restarted Redis has lost the registry, and
            # routers wait only briefly (one TTL) for workers to re-register.
            await asyncio.sleep(0.2 if failing else self.ttl / 3)
            if not self.visible:
                continue
            why = await self.healthy()
            if why and not self.withdrawn:
                await asyncio.sleep(self.recheck_s)
                again = await self.healthy()
                if not again:
                    log.warning("worker %s: a health check failed (%s) and passed on a recheck %.1fs later (a "
                                "stalled CPU or event loop?); staying registered", self.info.worker_id, why,
                                self.recheck_s)
                why = again
            if why:
                await self.withdraw(why)  # routers stop sending here; in-flight streams migrate
                continue
            if self.withdrawn:
                log.warning("worker %s recovered: registering again", self.info.worker_id)
                self.withdrawn = False
            try:
                if not await self.bus.heartbeat(self.info, self.ttl):
                    log.warning("worker %s: registration had expired (bus restarted or unreachable, or worker "
                                "stalled > %.0fs); re-registered, republishing its prefix cache",
                                self.info.worker_id, self.ttl)
                    await self._republish()
                failing = False
            except BusError as exc:
                if not failing:
                    log.warning("worker %s: heartbeat failed: %s (check the bus / Redis); retrying every 0.2 s",
                                self.info.worker_id, exc)
                failing = True

    async def _load_reports(self) -> None:
        while True:
            try:
                await self.bus.publish_load(self.load(), self.ttl)
            except BusError as exc:
                log.warning("worker %s: load report failed: %s", self.info.worker_id, exc)
            await asyncio.sleep(self.load_interval)

    async def _publish_events(self) -> None:
        """Everything queued goes in one bus call (a step's events, or what piled up while
        the last call was out): one message per batch, not per event, for every router."""
        pending: list[KVEvent] = []
        while True:
            if not pending:
                pending.append(await self._events.get())
            while len(pending) < PUBLISH_BATCH and not self._events.empty():
                pending.append(self._events.get_nowait())
            try:
                await self.bus.publish_kv_batch(pending)
                pending = []
            except BusError as exc:
                # Keep order and ids: retry the same events; routers resync on any gap anyway.
                log.warning("worker %s: KV events %d-%d not published: %s; retrying", self.info.worker_id,
                            pending[0].event_id, pending[-1].event_id, exc)
                await asyncio.sleep(0.5)


async def _always_healthy() -> str:
    return ""
