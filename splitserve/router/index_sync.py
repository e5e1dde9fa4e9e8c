"""Keeps a router's view of the cluster current: live workers, their load reports, and
the radix index fed by their KV event streams.

Per worker:
- precise mode once it has published a KV event: events are applied in order; an
  event-id gap (or a step backwards that is not a `cleared` restart) means events were
  missed, so the worker is resynced: its entries are cleared and its stream replayed
  from the start (gaps inside that replay are tolerated: they are history);
- approximate mode until then: the router's own decisions (`record_routed`) stand in,
  with a TTL;
- a worker whose registration expires leaves the index; if it comes back, its stream
  is replayed from the start.
Every replica that reads the same streams ends with the same index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.cluster.bus import START, BusError, ClusterBus, KVRecord, parse_position
from splitserve.cluster.messages import (
    LoadReport,
    WorkerInfo,
    kv_dtype_refusal,
    registration_refusal,
)
from splitserve.cluster.registration_auth import signature_refusal
from splitserve.metrics import Metrics
from splitserve.router.radix_index import RadixIndex
from splitserve.router.tier_scoring import tier_holder

log = logging.getLogger(__name__)


@dataclass
class WorkerState:
    info: WorkerInfo
    position: str = START  # last stream entry applied
    last_event_id: int | None = None
    precise: bool = False  # has published events (else: approximate mode)
    replay_end: tuple[int, int] | None = None  # replaying history up to this entry
    resyncs: int = 0


class IndexSync:
    def __init__(self, bus: ClusterBus, index: RadixIndex, *, approx_ttl: float = 60.0,
                 refresh_interval: float = 1.0, read_block: float = 0.5, batch: int = 1000,
                 metrics: Metrics | None = None, model: str | None = None, block_size: int | None = None,
                 on_departure=None, token: str | None = None):
        self.bus = bus
        self.index = index
        self.approx_ttl = approx_ttl
        self.refresh_interval = refresh_interval
        self.read_block = read_block
        self.batch = batch
        self.metrics = metrics
        self.model = model  # workers serving another model or block size are refused
        self.block_size = block_size
        self.token = token  # with a cluster token, only registrations signed with it are routed to
        self.on_departure = on_departure  # called with a worker id when it leaves the registry
        self.workers: dict[str, WorkerState] = {}
        self.loads: dict[str, LoadReport] = {}
        self.refused: dict[str, str] = {}  # worker id -> why (logged once per registration)
        self._stopped = False

    # ---- what the router asks --------------------------------------------------------
    def live(self, role: str) -> list[str]:
        """Workers of `role` that take new requests (registered, not draining)."""
        return [w for w, st in self.workers.items() if st.info.role == role and not st.info.draining]

    def draining(self) -> list[str]:
        return [w for w, st in self.workers.items() if st.info.draining]

    def mode(self, worker_id: str) -> str:
        st = self.workers.get(worker_id)
        return "precise" if st is not None and st.precise else "approximate"

    def record_routed(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Called after each routing decision; only counts for workers without events."""
        st = self.workers.get(worker_id)
        if st is not None and not st.precise:
            self.index.record_routed(worker_id, hashes, self.approx_ttl)

    # ---- refresh: registry and loads ---------------------------------------------------
    async def refresh(self) -> None:
        registered = await self.bus.live_workers()
        live: dict[str, WorkerInfo] = {}
        # workers already admitted first, then newcomers by start time: the first fixes the KV dtype
        for w, info in sorted(registered.items(), key=lambda kv: (kv[0] not in self.workers, kv[1].started_at)):
            if self._admissible(info, live.values()):
                live[w] = info
        for worker_id in [w for w in self.workers if w not in live]:
            log.warning("worker %s left the registry (stopped heartbeating, deregistered or unhealthy): dropping "
                        "its %d blocks from the router index", worker_id, self.index.blocks_of(worker_id))
            del self.workers[worker_id]
            self.index.remove_worker(worker_id)
            self.index.remove_worker(tier_holder(worker_id))
            if self.metrics is not None:
                with contextlib.suppress(KeyError):  # no poll ran since it joined
                    self.metrics.router_index_worker_blocks.remove(worker_id)
            if self.on_departure is not None:
                self.on_departure(worker_id)
        for worker_id, info in live.items():
            st = self.workers.get(worker_id)
            if st is None:
                self.workers[worker_id] = WorkerState(
                    info, replay_end=parse_position(await self.bus.kv_tail(worker_id)))
                log.info("worker %s (%s at %s) joined; replaying its KV events", worker_id,
                         info.role, info.address)
            else:
                if (info.started_at, info.address) != (st.info.started_at, st.info.address):
                    # a restart under the same id (crashed container, replacement pod): its
                    # `cleared` event resets its index entries; requests now dial the new address
                    log.info("worker %s (%s) restarted: now at %s (was %s)", worker_id, info.role,
                             info.address, st.info.address)
                st.info = info
        self.loads = {w: r for w, r in (await self.bus.loads()).items() if w in self.workers}
        if self.metrics is not None:
            for role in ("prefill", "decode"):
                self.metrics.workers_healthy.labels(role=role).set(len(self.live(role)))

    def _admissible(self, info: WorkerInfo, peers) -> bool:
        refusal = (signature_refusal(info, self.token) or registration_refusal(info, self.model, self.block_size)
                   or kv_dtype_refusal(info, peers))
        if refusal is None:
            self.refused.pop(info.worker_id, None)
            return True
        reason, message = refusal
        key = f"{reason}@{info.started_at}"
        if self.refused.get(info.worker_id) != key:  # once per registration, not once a second
            self.refused[info.worker_id] = key
            log.error("router: %s", message)
            if self.metrics is not None:
                self.metrics.worker_registrations_refused.labels(reason=reason).inc()
        return False

    # ---- KV events ---------------------------------------------------------------------
    async def poll(self, block: float | None = None) -> int:
        """Read and apply one batch of events; returns how many were applied."""
        positions = {w: st.position for w, st in self.workers.items()}
        records = await self.bus.read_kv(positions, block=block, count=self.batch)
        gapped: set[str] = set()
        applied = 0
        for record in records:
            if record.worker_id in gapped:
                continue  # the rest of its batch comes again in the replay
            if self._apply(record):
                applied += 1
            elif record.worker_id in self.workers:
                gapped.add(record.worker_id)
        for worker_id in gapped:
            await self._resync(worker_id)
        self.index.flush_touches()  # the routing decisions' LRU touches, off their path
        if self.metrics is not None:
            self.metrics.router_index_blocks.set(self.index.num_blocks)
            for worker_id in self.workers:
                self.metrics.router_index_worker_blocks.labels(worker=worker_id).set(self.index.blocks_of(worker_id))
        return applied

    async def catch_up(self) -> int:
        """Refresh, then apply everything already published (router start-up)."""
        await self.refresh()
        total = 0
        while n := await self.poll():
            total += n
        return total

    def _apply(self, record: KVRecord) -> bool:
        """Apply one event; False when it reveals a gap (or its worker has left)."""
        st = self.workers.get(record.worker_id)
        if st is None:
            return False
        w, ev, pos = record.worker_id, record.event, parse_position(record.position)
        replaying = st.replay_end is not None and pos <= st.replay_end
        expected = None if st.last_event_id is None else st.last_event_id + 1
        if expected is not None and ev.event_id != expected and ev.kind != "cleared":
            if not replaying:
                log.warning("KV event gap from worker %s: expected event %d, got %d; "
                            "resyncing its index entries from its stream", w, expected,
                            ev.event_id)
                return False
            log.info("worker %s's stream history skips from event %d to %d (trimmed or "
                     "lost); replaying on", w, expected - 1, ev.event_id)
        if not st.precise:  # first event: its own reports replace the router's guesses
            self.index.clear_worker(w)
            st.precise = True
        # blocks in the worker's offload tiers (host, disk) have a holder of their own
        holder = w if getattr(ev, "tier", "device") == "device" else tier_holder(w)
        if ev.kind == "stored":
            self.index.apply_stored(holder, ev.parent, ev.block_hashes)
        elif ev.kind == "removed":
            self.index.apply_removed(holder, ev.block_hashes)
        elif ev.kind == "cleared":
            self.index.clear_worker(w)
            self.index.clear_worker(tier_holder(w))
        else:
            log.error("worker %s sent KV event %d of unknown kind %r; ignored", w,
                      ev.event_id, ev.kind)
        st.last_event_id, st.position = ev.event_id, record.position
        if st.replay_end is not None and pos >= st.replay_end:
            st.replay_end = None
        return True

    async def _resync(self, worker_id: str) -> None:
        st = self.workers[worker_id]
        self.index.clear_worker(worker_id)
        self.index.clear_worker(tier_holder(worker_id))
        st.position, st.last_event_id, st.resyncs = START, None, st.resyncs + 1
        st.replay_end = parse_position(await self.bus.kv_tail(worker_id))
        if self.metrics is not None:
            self.metrics.router_index_resyncs.labels(worker=worker_id).inc()

    # ---- the background loop -----------------------------------------------------------
    async def run(self) -> None:
        """Refresh and follow the streams until `stop()`; bus outages are retried."""
        loop = asyncio.get_running_loop()
        next_refresh = 0.0
        backoff = 0.1
        while not self._stopped:
            try:
                if loop.time() >= next_refresh:
                    await self.refresh()
                    next_refresh = loop.time() + self.refresh_interval
                await self.poll(block=min(self.read_block, self.refresh_interval))
                backoff = 0.1
            except BusError as exc:
                log.error("router index sync: %s (retrying in %.1fs; routing continues on "
                          "the last known state)", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # a bug must not silently freeze the index: log, go on
                log.exception("router index sync failed; retrying in %.1fs (routing "
                              "continues on the last known state)", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def stop(self) -> None:
        self._stopped = True
