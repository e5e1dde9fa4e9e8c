"""One PushBlocks stream at the decode worker: header, lease, then the blocks.

grpc backend: the chunks are written into the leased blocks as they arrive and each
block is checked against the checksum carried by the chunk that completes it. mooncake backend: the bytes were
written one-sided by the sender; its reports of landed writes are verified in place,
and the push is answered at its commit (see docs/kv_transfer.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from splitserve.core import tracing
from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import frames
from splitserve.kvtransfer import outcome as R
from splitserve.kvtransfer.frames import Frame, FrameError, pb
from splitserve.kvtransfer.lease import Lease, LeaseError, LeaseTable
from splitserve.kvtransfer.one_sided import WrittenBlocks
from splitserve.kvtransfer.pool_io import RegionLayout, StreamWriter
from splitserve.kvtransfer.stream_guard import PeerBusy, StreamGuard
from splitserve.kvtransfer.wire import TransferHeader, WireError, validate_header

log = logging.getLogger(__name__)


class _StreamBroken(Exception):
    pass


def _next(stream) -> Frame | None:
    """Next frame, None at the end of the stream; _StreamBroken if the sender vanished."""
    try:
        frame = next(stream)
    except StopIteration:
        return None
    except grpc.RpcError as exc:  # the client cancelled, hit its deadline or died
        raise _StreamBroken("the sender's stream broke (sender cancelled, timed out or died)") from exc
    if isinstance(frame, FrameError):
        raise ValueError(f"malformed KVChunk: {frame}")
    return frame


class PushHandler:
    """The PushBlocks handler of one KVReceiver (called on gRPC's threads)."""

    def __init__(self, pool: KVCachePool, leases: LeaseTable, epoch: str, one_sided: bool, worker_id: str,
                 count_bytes: Callable[[str, int], None], guard: StreamGuard):
        self.pool = pool
        self.leases = leases
        self.epoch = epoch
        self.one_sided_enabled = one_sided  # this receiver runs the mooncake backend
        self.worker_id = worker_id
        self._count_bytes = count_bytes
        self.guard = guard

    def __call__(self, stream, context) -> pb.PushAck:
        try:
            slot = self.guard.enter(context.peer(), context)
        except PeerBusy as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            with tracing.span("kv_receive", tracing.extract_grpc(context), "server") as span:
                ack = self._serve(self.guard.watch(slot, stream), context)
                span.set_attributes({"splitserve.kv.status": pb.PushStatus.Name(ack.status),
                                     "splitserve.kv.bytes": ack.bytes_received, "gen_ai.response.id": ack.request_id or None})
                return ack
        finally:
            self.guard.leave(slot)

    def _serve(self, stream, context) -> pb.PushAck:
        try:
            first = _next(stream)
        except (_StreamBroken, ValueError) as exc:
            return _ack("", "BAD_STREAM", str(exc))
        if first is None or first.header is None:
            return _ack("", "BAD_STREAM", "a PushBlocks stream must start with a header message")
        try:
            header = TransferHeader.decode(first.header)
        except WireError as exc:
            return _ack("", "BAD_HEADER", str(exc))
        rid = header.request_id
        problem = validate_header(header, self.pool.spec, self.pool.num_blocks, self.epoch)
        one_sided = header.backend == "mooncake"
        if problem is None and one_sided and not self.one_sided_enabled:
            problem = "this decode worker's receiver does not run the mooncake backend (configure both ends alike)"
        if problem is not None and header.receiver_epoch != self.epoch:
            # described before this worker restarted: nothing was written, and the lease (this
            # process's own) stays open for the sender to describe us again and push
            return _ack(rid, "BAD_HEADER", problem, retry_allowed=True)
        if problem is not None:
            self.leases.fail_request(rid, R.BAD_HEADER, problem)
            return _ack(rid, "BAD_HEADER", problem)
        try:
            lease = self.leases.attach(header, one_sided)
        except LeaseError as exc:
            return _ack(rid, exc.status, exc.detail)
        lost = None
        try:
            if one_sided:
                context.send_initial_metadata(((frames.LEASE_METADATA_KEY, frames.LEASE_GRANTED),))
                return self._verify_one_sided(lease, header, stream)
            return self._receive_chunks(lease, header, stream)
        except _StreamBroken as exc:
            lost = f"{exc} after {lease.bytes_received} of {header.total_nbytes} bytes"
            return _ack(rid, "BAD_STREAM", lost)
        except LeaseError as exc:
            return _ack(rid, exc.status, exc.detail)
        except ValueError as exc:  # malformed or out-of-order chunks: the sender is broken
            self.leases.fail(lease, R.BAD_STREAM, f"request {rid!r}: {exc}")
            return _ack(rid, "BAD_STREAM", str(exc))
        finally:
            self.leases.detach(lease, header, one_sided, lost)

    def _receive_chunks(self, lease: Lease, header: TransferHeader, stream) -> pb.PushAck:
        layout = RegionLayout.of(self.pool, (header.layer_start, header.layer_end))
        writer = StreamWriter(self.pool, header.dest_block_ids, layout)
        rid = header.request_id
        while writer.received < writer.total:
            frame = _next(stream)
            if frame is None:
                raise _StreamBroken("the sender closed its stream early")
            if frame.header is not None or frame.commit or frame.data is None:
                raise ValueError("expected a data chunk (a second header or a commit arrived)")
            self.leases.begin_io(lease)
            try:
                completed = writer.write(frame.offset, frame.data)
            finally:
                self.leases.end_io(lease, len(frame.data))
            self._count_bytes(header.backend, len(frame.data))
            sums = dict(zip(frame.written, frame.written_checksums, strict=True))
            if sorted(sums) != [i for i, _ in completed]:
                raise ValueError(f"the chunk at byte {frame.offset} completes stream blocks {[i for i, _ in completed]} "
                                 f"but carries checksums for {sorted(sums)}")
            bad = [(i, d, sums[i]) for i, d in completed if d != sums[i]]
            if bad:
                return self._corrupted(lease, header, bad, writer.received)
        if not self.leases.push_succeeded(lease, header):
            raise LeaseError("LEASE_EXPIRED", f"request {rid!r} ended before its last chunk was written")
        return _ack(rid, "PUSH_OK", "", bytes_received=writer.received)

    def _verify_one_sided(self, lease: Lease, header: TransferHeader, stream) -> pb.PushAck:
        """Verify blocks as the sender reports them landed; answer at its commit. The sender
        keeps the stream open while any write is in flight, so even a push that already
        failed here is read to its commit (or break) before answering: until then the
        lease must go on treating the blocks as written into."""
        blocks = WrittenBlocks(self.pool, header)
        problem: Exception | None = None  # the first LeaseError / ValueError: verification stops
        while True:
            try:
                frame = _next(stream)
            except ValueError as exc:  # a malformed message: still read on to the commit
                problem = problem or exc
                continue
            if frame is None:
                raise _StreamBroken("the sender closed its stream without committing its writes")
            if problem is None and (frame.header is not None or frame.data is not None):
                problem = ValueError("expected written-block reports or the commit of a one-sided transfer")
            if frame.written and problem is None:
                problem = self._verify_reported(lease, header, blocks, frame)
            if frame.commit:
                break
        if problem is not None:
            raise problem
        missing = blocks.missing()
        if missing:
            raise ValueError(f"commit before stream blocks {missing[:8]} were reported written ({len(missing)} missing)")
        if blocks.mismatches:
            return self._corrupted(lease, header, blocks.mismatches, header.total_nbytes)
        if not self.leases.push_succeeded(lease, header):
            raise LeaseError("LEASE_EXPIRED", f"request {header.request_id!r} ended before its commit arrived")
        return _ack(header.request_id, "PUSH_OK", "", bytes_received=header.total_nbytes)

    def _verify_reported(self, lease: Lease, header: TransferHeader, blocks: WrittenBlocks,
                         frame: Frame) -> Exception | None:
        try:
            self.leases.begin_io(lease)
        except LeaseError as exc:  # aborted or expired meanwhile: answered at the commit
            return exc
        nbytes = 0
        try:
            nbytes = blocks.report(frame.written, frame.written_checksums)
        except ValueError as exc:
            return exc
        finally:
            self.leases.end_io(lease, nbytes)
        self._count_bytes(header.backend, nbytes)
        return None

    def _corrupted(self, lease: Lease, header: TransferHeader, bad: list[tuple[int, int, int]],
                   nbytes: int) -> pb.PushAck:
        i, got, want = bad[0]
        detail = (f"request {header.request_id!r}: {len(bad)} block(s) failed their checksum, first stream block {i} "
                  f"(destination block {header.dest_block_ids[i]}): xxh3 {got:#018x}, the sender's is {want:#018x}")
        log.warning("KV receiver %s: %s", self.worker_id, detail)
        retry = self.leases.checksum_failed(lease, detail)
        if not retry:
            detail += f"; gave up after {lease.failed_attempts} corrupted pushes, the lease is released"
        return _ack(header.request_id, "CHECKSUM_MISMATCH", detail, retry_allowed=retry, bytes_received=nbytes)


def _ack(request_id: str, status: str, detail: str, retry_allowed: bool = False,
         bytes_received: int = 0) -> pb.PushAck:
    return pb.PushAck(request_id=request_id, status=pb.PushStatus.Value(status), detail=detail,
                      retry_allowed=retry_allowed, bytes_received=bytes_received)
