"""mooncake backend, sender side: one-sided writes into the receiver's pool, confirmed over gRPC.

One attempt:
  1. open PushBlocks and send the header; the receiver attaches it to the request's
     lease and answers with initial metadata `x-splitserve-lease: granted` (or an ack
     refusing it: nothing is written into blocks that are not leased to us);
  2. write every block region straight from our pool to its destination address
     (Mooncake Transfer Engine, tcp or rdma); adjacent regions go as one write. Under
     tensor parallelism on either side, a block goes as one write per receiver rank,
     each carrying that rank's KV heads into its pool shard (segments.py);
  3. as each block's writes have landed, hash its source region and report it with its
     checksum (a `written` frame); the receiver verifies those blocks while the
     rest are still on the wire;
  4. send `commit` once every write ended; the receiver acknowledges.
The stream stays open for the whole write, so the receiver knows a writer is active:
if we die, the stream breaks and the receiver fails the lease; if we give up at our
deadline while a write is still on the wire, we close the stream only once the write
returned, and without committing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import xxhash

from splitserve.core import tracing
from splitserve.engine.kv_cache import KVCachePool
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.kvtransfer import frames
from splitserve.kvtransfer.frames import LEASE_GRANTED, LEASE_METADATA_KEY, pb
from splitserve.kvtransfer.mooncake_endpoint import MooncakeEndpoint, MooncakeError, Write, coalesce
from splitserve.kvtransfer.outcome import KVTransferError
from splitserve.kvtransfer.pool_io import RegionLayout
from splitserve.kvtransfer.segments import (
    OneSidedPlan,
    Segment,
    check_segments,
    plan,
    pool_regions,
    pool_segments,
)
from splitserve.kvtransfer.sender import KVSender
from splitserve.kvtransfer.wire import ReceiverInfo, TransferHeader, WireError


class _Attempt:
    """Who may still touch the stream: the writer thread or the caller who gave up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writing = False
        self.abandoned = False


class _Reports:
    """The `written` reports: landed blocks' regions, hashed once every one of the block's
    `parts` writes (one per receiver segment) landed.

    Hashing a write's source once it landed overlaps the checksums with the writes
    still on the wire, and the receiver verifies the reported blocks while later ones
    travel. Reports go out per REPORT_BYTES landed (each one wakes the receiver), the
    rest with the commit. Hashing a region before or while the transport sends it
    measured slower here; once it landed, the transport is done with it."""

    REPORT_BYTES = 8 << 20

    def __init__(self, regions: list[memoryview], outbox: queue.SimpleQueue, parts: int = 1):
        self.regions = regions
        self.outbox = outbox
        self.unlanded = [parts] * len(regions)  # writes of each stream block still on the wire
        self.indices: list[int] = []
        self.sums: list[int] = []
        self.nbytes = 0

    def landed(self, write: Write) -> None:
        for i in range(write.first, write.first + write.count):
            self.unlanded[i] -= 1
            if self.unlanded[i]:
                continue
            self.indices.append(i)
            self.sums.append(xxhash.xxh3_64_intdigest(self.regions[i]))
            self.nbytes += len(self.regions[i])
        if self.nbytes >= self.REPORT_BYTES:
            self._send(commit=False)

    def commit(self) -> None:
        self._send(commit=True)

    def _send(self, commit: bool) -> None:
        self.outbox.put(frames.encode_written(self.indices, self.sums, commit=commit))
        self.indices, self.sums, self.nbytes = [], [], 0


def plan_writes(src_pool: KVCachePool, src_block_ids: Sequence[int], dest_block_ids: Sequence[int],
                layout: RegionLayout, dest_pool_base: int) -> list[Write]:
    """The one-sided writes that put each source block's region at its destination block
    in the receiver's registered pool (adjacent regions merged)."""
    src = [src_pool.data_ptr() + layout.offset(b) for b in src_block_ids]
    dst = [dest_pool_base + layout.offset(d) for d in dest_block_ids]
    return coalesce(src, dst, layout.region_nbytes)


class MooncakeSender(KVSender):
    backend = "mooncake"

    def __init__(self, config=None, metrics=None):
        super().__init__(config, metrics)
        self._endpoint: MooncakeEndpoint | None = None
        self._writers = ThreadPoolExecutor(max_workers=self.config.max_concurrent_pushes,
                                           thread_name_prefix="kv-mooncake-write")

    def _endpoint_for(self, pool: KVCachePool | ShardedKVPool) -> MooncakeEndpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = MooncakeEndpoint(self.config.host, self.config.mooncake_protocol,
                                                  self.config.mooncake_device)
            endpoint = self._endpoint
        for region in pool_regions(pool):  # once per pool (each rank's shard under TP)
            endpoint.register(*region)
        return endpoint

    def _attempt(self, address: str, info: ReceiverInfo, header: TransferHeader, src_pool: KVCachePool,
                 src_block_ids: Sequence[int], layout: RegionLayout, regions: list[memoryview],
                 deadline: float) -> pb.PushAck:
        rid = header.request_id
        if not info.mooncake_session:
            raise KVTransferError(rid, address, "backend_mismatch",
                                  "the receiver does not run the mooncake backend; configure both workers alike")
        endpoint = self._endpoint_for(src_pool)
        writes = self._plan_writes(endpoint, src_pool, src_block_ids, header, layout, info, regions)

        outbox: queue.SimpleQueue = queue.SimpleQueue()
        outbox.put(frames.encode_header(header.encode()))
        left = self._remaining(deadline, rid, address)
        # The gRPC deadline is only a backstop (so the call cannot outlive us by much):
        # the stream must not end while our write may still land, see the module doc.
        call = frames.push_stub(self._channel(address)).future(iter(outbox.get, None),
                                                               timeout=left + self.config.timeout_s,
                                                               metadata=tracing.inject(self.config.security.metadata))
        attempt = _Attempt()
        reports = _Reports(regions, outbox, writes.parts)
        try:
            self._register_staged(endpoint, writes)  # unregistered by the writer, which ends every write
        except MooncakeError as exc:
            outbox.put(None)
            call.cancel()
            raise KVTransferError(rid, address, "write_failed", str(exc)) from None
        writer = self._writers.submit(self._write, call, outbox, attempt, endpoint, info.mooncake_session, writes,
                                      reports)
        try:
            writer.result(timeout=left)
        except FutureTimeout:
            with attempt.lock:
                attempt.abandoned = True
                writing = attempt.writing
            if not writing:
                call.cancel()
            step = "the one-sided write was still running" if writing else "the receiver did not grant the lease"
            raise KVTransferError(rid, address, "deadline", f"{step} at the deadline; is the decode worker alive?") from None
        except MooncakeError as exc:
            raise KVTransferError(rid, address, "write_failed", str(exc)) from None
        try:
            return call.result(timeout=self._remaining(deadline, rid, address))
        except grpc.FutureTimeoutError:
            call.cancel()
            raise KVTransferError(rid, address, "deadline",
                                  "blocks written and committed but the receiver did not acknowledge in time") from None

    def _plan_writes(self, endpoint: MooncakeEndpoint, src_pool: KVCachePool | ShardedKVPool,
                     src_block_ids: Sequence[int], header: TransferHeader, layout: RegionLayout,
                     info: ReceiverInfo, regions: list[memoryview]) -> OneSidedPlan:
        """The writes into each of the receiver's segments (one per rank under TP)."""
        dest = [Segment(*s) for s in info.segments]
        problem = check_segments(dest, src_pool.spec.num_kv_heads)
        if problem:
            raise WireError(f"request {header.request_id!r}: the receiver's registered KV pool: {problem}")
        return plan(pool_segments(src_pool), dest, src_pool.spec, layout, src_block_ids, header.dest_block_ids,
                    regions)

    @staticmethod
    def _register_staged(endpoint: MooncakeEndpoint, writes: OneSidedPlan) -> None:
        done = []
        try:
            for buf in writes.staged:
                endpoint.register(buf.data_ptr(), buf.numel() * buf.element_size())
                done.append(buf)
        except MooncakeError:
            for buf in done:
                endpoint.unregister(buf.data_ptr())
            raise

    def _write(self, call, outbox: queue.SimpleQueue, attempt: _Attempt, endpoint: MooncakeEndpoint,
               session: str, writes: OneSidedPlan, reports: _Reports) -> bool:
        """Writer thread: wait for the lease, write and report, commit. Always closes the
        stream, and unregisters the push's staging buffers once no write reads them."""
        committed = False
        try:
            granted = dict(call.initial_metadata() or ()).get(LEASE_METADATA_KEY) == LEASE_GRANTED
            with attempt.lock:
                if not granted or attempt.abandoned:
                    return False
                attempt.writing = True
            endpoint.write(session, writes.writes, on_landed=reports.landed)
            with attempt.lock:
                if not attempt.abandoned:
                    reports.commit()
                    committed = True
            return committed
        finally:
            for buf in writes.staged:
                endpoint.unregister(buf.data_ptr())
            outbox.put(None)

    def close(self) -> None:
        super().close()
        self._writers.shutdown(wait=True)
        if self._endpoint is not None:
            self._endpoint.close()
