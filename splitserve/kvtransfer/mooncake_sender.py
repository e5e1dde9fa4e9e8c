"""mooncake backend, sender side: one-sided writes into the receiver's pool, confirmed over gRPC.

One attempt:
  1. open PushBlocks and send the header; the receiver attaches it to the request's
     lease and answers with initial metadata `x-splitserve-lease: granted` (or an ack
     refusing it: nothing is written into blocks that are not leased to us);
  2. write every block region straight from our pool to its destination address
     (Mooncake Transfer Engine, tcp or rdma); adjacent regions go as one write;
  3. as each write lands, hash its source regions and report them with their
     checksums (a `written` frame); the receiver verifies those blocks while the
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
from splitserve.kvtransfer import frames
from splitserve.kvtransfer.frames import LEASE_GRANTED, LEASE_METADATA_KEY, pb
from splitserve.kvtransfer.mooncake_endpoint import MooncakeEndpoint, MooncakeError, Write, coalesce
from splitserve.kvtransfer.outcome import KVTransferError
from splitserve.kvtransfer.pool_io import RegionLayout
from splitserve.kvtransfer.sender import KVSender
from splitserve.kvtransfer.wire import ReceiverInfo, TransferHeader


class _Attempt:
    """Who may still touch the stream: the writer thread or the caller who gave up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writing = False
        self.abandoned = False


class _Reports:
    """The `written` reports: landed writes' regions, hashed once they landed.

    Hashing a write's source once it landed overlaps the checksums with the writes
    still on the wire, and the receiver verifies the reported blocks while later ones
    travel. Reports go out per REPORT_BYTES landed (each one wakes the receiver), the
    rest with the commit. Hashing a region before or while the transport sends it
    measured slower here; once it landed, the transport is done with it."""

    REPORT_BYTES = 8 << 20

    def __init__(self, regions: list[memoryview], outbox: queue.SimpleQueue):
        self.regions = regions
        self.outbox = outbox
        self.indices: list[int] = []
        self.sums: list[int] = []
        self.nbytes = 0

    def landed(self, write: Write) -> None:
        for i in range(write.first, write.first + write.count):
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

    def _endpoint_for(self, pool: KVCachePool) -> MooncakeEndpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = MooncakeEndpoint(self.config.host, self.config.mooncake_protocol,
                                                  self.config.mooncake_device)
            endpoint = self._endpoint
        endpoint.register(pool.data_ptr(), pool.nbytes, pool.data.device.type)  # once per pool
        return endpoint

    def _attempt(self, address: str, info: ReceiverInfo, header: TransferHeader, src_pool: KVCachePool,
                 src_block_ids: Sequence[int], layout: RegionLayout, regions: list[memoryview],
                 deadline: float) -> pb.PushAck:
        rid = header.request_id
        if not info.mooncake_session:
            raise KVTransferError(rid, address, "backend_mismatch",
                                  "the receiver does not run the mooncake backend; configure both workers alike")
        endpoint = self._endpoint_for(src_pool)
        writes = self._plan_writes(endpoint, src_pool, src_block_ids, header, layout, info)

        outbox: queue.SimpleQueue = queue.SimpleQueue()
        outbox.put(frames.encode_header(header.encode()))
        left = self._remaining(deadline, rid, address)
        # The gRPC deadline is only a backstop (so the call cannot outlive us by much):
        # the stream must not end while our write may still land, see the module doc.
        call = frames.push_stub(self._channel(address)).future(iter(outbox.get, None),
                                                               timeout=left + self.config.timeout_s,
                                                               metadata=tracing.inject(self.config.security.metadata))
        attempt = _Attempt()
        reports = _Reports(regions, outbox)
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

    def _plan_writes(self, endpoint: MooncakeEndpoint, src_pool: KVCachePool, src_block_ids: Sequence[int],
                     header: TransferHeader, layout: RegionLayout, info: ReceiverInfo) -> list[Write]:
        return plan_writes(src_pool, src_block_ids, header.dest_block_ids, layout, info.pool_base)

    def _write(self, call, outbox: queue.SimpleQueue, attempt: _Attempt, endpoint: MooncakeEndpoint,
               session: str, writes: list[Write], reports: _Reports) -> bool:
        """Writer thread: wait for the lease, write and report, commit. Always closes the stream."""
        committed = False
        try:
            granted = dict(call.initial_metadata() or ()).get(LEASE_METADATA_KEY) == LEASE_GRANTED
            with attempt.lock:
                if not granted or attempt.abandoned:
                    return False
                attempt.writing = True
            endpoint.write(session, writes, on_landed=reports.landed)
            with attempt.lock:
                if not attempt.abandoned:
                    reports.commit()
                    committed = True
            return committed
        finally:
            outbox.put(None)

    def close(self) -> None:
        super().close()
        self._writers.shutdown(wait=True)
        if self._endpoint is not None:
            self._endpoint.close()
