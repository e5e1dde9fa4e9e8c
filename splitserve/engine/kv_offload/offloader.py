"""Moves KV blocks between the device pool and the offload tiers (host memory, disk).

Write-down happens when a cached block goes idle (its last user left; it stays cached on
the device's free list), not when it is evicted: the engine thread only notes the block
(`on_cached_free`, a dict insert) and a background writer copies its bytes to the host
tier while the block sits unused, off the step's critical path (outside the lock: the
engine thread never waits for a copy unless it reuses that very block). The device block
cannot change before it is reused, so the one fence is `before_reuse`: the engine thread, about
to hand the block out, takes its pending write from the writer; on a CPU pool it copies
the block itself when a host slot is free (a memcpy, no I/O), otherwise the write is
dropped (counted; the block is a miss later, never wrong). When the host tier is full the
writer evicts its least recently used block to the disk tier (a file write, on the writer).

Load-back (`load`) runs on the engine thread while it admits a sequence: a host hit is a
memcpy into a fresh device block, a disk hit a file read checked against its header, MAC
and checksum, on the disk thread with a timeout (guarded_disk.py: no disk failure ever reaches
the step; the worst is a recompute). Tier membership changes become KV events (tier "host" / "disk") so the
router can score a worker's offloaded prefix.

Under tensor parallelism everything above runs on rank 0, as for one rank: a block is every
rank's heads of it, gathered from and scattered to the ranks' pools, shared with rank 0
(device_blocks.py), so a tier entry is whole or absent and the ranks never hear of the tiers.

(Just over 300 lines: write-down, the reuse fence and load-back share one lock and one map of
pending writes, and their correctness is the order of those three; the tiers, the disk guard
and the device copies already live in their own modules.)
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch
import xxhash

from splitserve.core.block_events import BlockEvent
from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.engine.kv_offload.device_blocks import device_blocks
from splitserve.engine.kv_offload.disk_tier import DiskTier
from splitserve.engine.kv_offload.guarded_disk import GuardedDisk
from splitserve.engine.kv_offload.host_tier import HostTier
from splitserve.engine.kv_offload.stats import OffloadCounters, OffloadStats
from splitserve.engine.parallel.kv_shards import ShardedKVPool

log = logging.getLogger(__name__)

DIRECTORY_CHECK_S = 1.0  # how often an idle writer checks the disk tier's directory still exists


def layout_tag(spec: KVCacheSpec) -> int:
    """Identifies the byte layout of a block: a file written for another is foreign."""
    s = spec
    return xxhash.xxh3_64_intdigest(f"{s.block_shape}:{s.dtype}".encode())


class KVOffloader:
    def __init__(self, pool: KVCachePool | ShardedKVPool, host_bytes: int = 0, disk_dir: str | None = None,
                 disk_bytes: int = 0):
        """`pool`: the engine's KV pool, or under tensor parallelism every rank's as one (device_blocks.py)."""
        self.blocks = device_blocks(pool)
        self.block_nbytes = self.blocks.spec.block_nbytes
        on_gpu = self.blocks.on_gpu
        if host_bytes and host_bytes < self.block_nbytes:
            raise ValueError(f"--kv-offload-gib {host_bytes / 2**30:g} holds no KV block "
                             f"(a block is {self.block_nbytes} bytes)")
        self.host = HostTier(host_bytes // self.block_nbytes, self.block_nbytes, pin_memory=on_gpu) \
            if host_bytes else None
        self.disk = GuardedDisk(DiskTier(disk_dir, disk_bytes, self.block_nbytes, layout_tag(self.blocks.spec))) \
            if disk_dir else None
        self.sync_copy_ok = not on_gpu  # a device-to-host copy on the engine thread would stall the GPU
        self.lock = threading.Lock()
        # The writer copies a block outside the lock; only a reuse of that very block waits for it.
        self._copying: int | None = None
        self._copied = threading.Condition(self.lock)
        self.pending: dict[int, int] = {}  # device block -> hash, waiting for the writer
        self.counters = OffloadCounters()
        self._events: list[BlockEvent] = []
        self._rewrite: list[int] = []  # lost with the disk tier's directory: write down again if still cached
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._writer = threading.Thread(target=self._run, name="kv-offload-writer", daemon=True)
        self._writer.start()

    # ---- engine thread ------------------------------------------------------------------
    def on_cached_free(self, block_id: int, block_hash: int) -> None:
        """A published block's last user left: write it down unless a tier has it."""
        with self.lock:
            if self.host is not None and block_hash in self.host:
                self.host.touch(block_hash)
                return
            if self.host is None and block_hash in self.disk:
                return
            self.pending[block_id] = block_hash
        self._queue.put(block_id)

    def before_reuse(self, block_id: int) -> None:
        """The device block is about to be overwritten: its pending write happens now or never."""
        with self.lock:
            while self._copying == block_id:  # the writer is copying it now: a few tens of microseconds
                self._copied.wait()
            h = self.pending.pop(block_id, None)
            if h is None:
                return
            slot = self.host.take_slot() if self.host is not None and self.sync_copy_ok else None
            if slot is None:
                self.counters.dropped_blocks += 1
                return
            self._copy_to_host(block_id, h, slot)

    def match(self, hashes: list[int]) -> int:
        """How many of `hashes`, from the first, a tier holds (the disk tier's only while it is usable)."""
        n = 0
        disk = self.disk if self.disk is not None and self.disk.usable else None
        with self.lock:
            for h in hashes:
                if not ((self.host is not None and h in self.host) or (disk is not None and h in disk)):
                    break
                n += 1
            self.counters.lookup_blocks += len(hashes)
            self.counters.hit_blocks += n
        return n

    def load(self, block_hash: int, block_id: int) -> bool:
        """Copy the block `block_hash` from a tier into device block `block_id`; False: a miss."""
        with self.lock:
            slot = self.host.lookup(block_hash) if self.host is not None else None
            if slot is not None:
                self.blocks.write_from(block_id, self.host.slot(slot))
                self.host.touch(block_hash)
                self.counters.loaded_blocks["host"] += 1
                return True
        if self.disk is None:
            return False
        payload = self.disk.read(block_hash)  # on the disk thread, bounded; counted and logged there
        with self.lock:
            self._drop_lost()
            if payload is None:
                self.counters.read_failures += 1
                self._left_tiers(block_hash, "disk")
                return False
            self.blocks.write_from(block_id, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self.counters.loaded_blocks["disk"] += 1
        return True

    def take_rewrites(self) -> list[int]:
        """Hashes whose files went with the disk tier's directory: the engine thread notes again
        those still cached on the device (on_cached_free), so they reach the new directory."""
        with self.lock:
            if self.disk is not None:
                self._drop_lost()
            hashes, self._rewrite = self._rewrite, []
        return hashes

    def drain_events(self) -> list[BlockEvent]:
        with self.lock:
            events, self._events = self._events, []
        return events

    def clear(self) -> None:
        """Forget everything (the prefix cache was reset)."""
        with self.lock:
            self.pending.clear()
            gone = self.host.clear() if self.host is not None else []
        gone += self.disk.clear() if self.disk is not None else []  # the files go on the disk thread
        with self.lock:
            for h in dict.fromkeys(gone):
                self._removed(h, "host")

    def stats(self) -> OffloadStats:
        with self.lock:
            c = self.counters
            counters = OffloadCounters(dict(c.stored_blocks), dict(c.loaded_blocks), c.lookup_blocks, c.hit_blocks,
                                       c.dropped_blocks, c.write_failures, c.read_failures)
            host, disk = self.host, self.disk  # (an empty tier is falsy: it has a length)
            if disk is not None:
                counters.disk_failures = disk.failure_counts()
            return OffloadStats(self.block_nbytes, len(host) if host is not None else 0,
                                host.capacity if host is not None else 0, len(disk) if disk is not None else 0,
                                disk.tier.effective_capacity if disk is not None else 0, len(self.pending), counters,
                                disk_on=disk.usable if disk is not None else True)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once every noted block was written down and the disk thread has done what was
        posted to it (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return self.disk is None or self.disk.flush(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the writer and remove the disk tier's files and directory: the tiers die with the
        worker, so the blocks not yet written down are not written at all."""
        with self.lock:
            self.pending.clear()  # the writer skips what is queued
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=30)
        if self.disk is not None:
            self.disk.close()

    # ---- the writer thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                block_id = self._queue.get(timeout=DIRECTORY_CHECK_S)
            except queue.Empty:  # idle: is the disk tier's directory still there?
                if self.disk is not None:
                    self.disk.check_directory()
                continue
            try:
                if block_id is None:
                    return
                self._write_down(block_id)
            except Exception:  # a bug must not end write-down silently for the worker's life
                log.exception("KV offload: writing down block %s failed", block_id)
            finally:
                self._queue.task_done()

    def _write_down(self, block_id: int) -> None:
        if self.host is None:  # disk only: copy the block out, then write the file
            with self.lock:
                h = self.pending.pop(block_id, None)
                if h is None or h in self.disk:
                    return
                self._copying = block_id
            try:
                buffer = torch.empty(self.block_nbytes, dtype=torch.uint8)
                self.blocks.read_into(block_id, buffer)
                payload = bytes(memoryview(buffer.numpy()))
            finally:
                self._copy_done()
            self._to_disk(h, memoryview(payload), newly_tiered=True)
            return
        slot = self._free_host_slot()
        with self.lock:
            h = self.pending.pop(block_id, None)
            if h is None or h in self.host:
                self.host.give_back(slot)
                return
            self._copying = block_id
        try:
            self.blocks.read_into(block_id, self.host.slot(slot))  # the slot is only this thread's
        except BaseException:
            self._copy_done()
            with self.lock:
                self.host.give_back(slot)
            raise
        with self.lock:
            self._copying = None
            self._copied.notify_all()
            self._publish_host(h, slot)

    def _copy_done(self) -> None:
        with self.lock:
            self._copying = None
            self._copied.notify_all()

    def _free_host_slot(self) -> int:
        """A host slot to fill; when all are taken, the least recently used block goes to disk."""
        with self.lock:
            slot = self.host.take_slot()
            if slot is not None:
                return slot
            h, slot = self.host.pop_lru()
            if self.disk is None:
                self._left_tiers(h, "host")
                return slot
        # Unindexed now: nothing reads the slot and only this thread reuses it.
        self._to_disk(h, memoryview(self.host.slot(slot).numpy()), newly_tiered=False)
        return slot

    def _to_disk(self, h: int, payload: memoryview, newly_tiered: bool) -> None:
        written, evicted = self.disk.write(h, payload)  # on the disk thread, bounded; failures logged there
        with self.lock:
            self._drop_lost()
            for e in evicted:
                self._left_tiers(e, "disk")
            if written:
                self.counters.stored_blocks["disk"] += 1
                if newly_tiered:
                    self._events.append(BlockEvent("stored", [h], tier="disk"))
            else:
                self.counters.write_failures += 1
                self._left_tiers(h, "disk")

    def _drop_lost(self) -> None:
        """Blocks whose files went with the disk tier's directory (deleted under it): removed events."""
        for h in self.disk.take_lost():
            self._left_tiers(h, "disk")
            self._rewrite.append(h)

    # ---- under the lock ------------------------------------------------------------------
    def _copy_to_host(self, block_id: int, h: int, slot: int) -> None:
        self.blocks.read_into(block_id, self.host.slot(slot))
        self._publish_host(h, slot)

    def _publish_host(self, h: int, slot: int) -> None:
        self.host.publish(h, slot)
        self.counters.stored_blocks["host"] += 1
        if self.disk is None or h not in self.disk:
            self._events.append(BlockEvent("stored", [h], tier="host"))

    def _left_tiers(self, h: int, tier: str) -> None:
        """`h` left one tier: an event when no tier holds it any more."""
        if (self.host is not None and h in self.host) or (self.disk is not None and h in self.disk):
            return
        self._removed(h, tier)

    def _removed(self, h: int, tier: str) -> None:
        last = self._events[-1] if self._events else None
        if last is not None and last.kind == "removed" and last.tier == tier:
            last.block_hashes.append(h)
        else:
            self._events.append(BlockEvent("removed", [h], tier=tier))


def build_offloader(config, pool: KVCachePool | ShardedKVPool) -> KVOffloader | None:
    """The tiers an EngineConfig asks for, or None (no --kv-offload-gib / --kv-offload-dir).
    Under tensor parallelism `pool` is every rank's pool as one (LLMEngine.share_kv_pool)."""
    if not config.kv_offload_bytes and not config.kv_offload_dir:
        return None
    return KVOffloader(pool, config.kv_offload_bytes, config.kv_offload_dir, config.kv_offload_dir_bytes)
