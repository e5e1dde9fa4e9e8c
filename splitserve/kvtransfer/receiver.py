"""KVReceiver: the decode worker's end of KV transfer.

The decode worker allocates destination blocks, then calls expect() with them and a
release callback; the receiver serves PushBlocks on gRPC, writes (grpc backend) or
verifies (mooncake backend, whose bytes were written one-sided) the blocks, and
resolves the returned future with a TransferOutcome. On failure it hands the blocks
back through the callback exactly once, when nothing can still write into them.
The callback runs on a receiver thread: make it thread-safe (e.g. hop to your loop).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import frames
from splitserve.kvtransfer import outcome as R
from splitserve.kvtransfer.config import KVTransferConfig
from splitserve.kvtransfer.frames import Frame, FrameError, pb
from splitserve.kvtransfer.lease import Lease, LeaseError, LeaseTable
from splitserve.kvtransfer.malloc_tuning import reuse_message_buffers
from splitserve.kvtransfer.mooncake_endpoint import MooncakeEndpoint
from splitserve.kvtransfer.one_sided import WrittenBlocks
from splitserve.kvtransfer.pool_io import RegionLayout, StreamWriter
from splitserve.kvtransfer.wire import (
    ReceiverInfo,
    TransferHeader,
    WireError,
    dtype_name,
    validate_header,
)
from splitserve.metrics import Metrics
from splitserve.security.tls import add_port

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


class KVReceiver:
    def __init__(self, pool: KVCachePool, config: KVTransferConfig | None = None,
                 metrics: Metrics | None = None, worker_id: str = "decode"):
        self.pool = pool
        self.config = config or KVTransferConfig()
        self.metrics = metrics
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex
        self.leases = LeaseTable(self.config.max_attempts, self.config.one_sided_quarantine_s,
                                 on_outcome=self._record_outcome)
        self._server: grpc.Server | None = None
        self._mooncake: MooncakeEndpoint | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._reaper: threading.Thread | None = None
        self.address = ""

    # ---- lifecycle ------------------------------------------------------------
    def start(self) -> str:
        cfg = self.config
        reuse_message_buffers(cfg.message_limit)
        if cfg.backend == "mooncake":
            self._mooncake = MooncakeEndpoint(cfg.host, cfg.mooncake_protocol, cfg.mooncake_device)
            self._mooncake.register(self.pool.data_ptr(), self.pool.nbytes)  # once, for the pool's lifetime
        slots = cfg.max_concurrent_pushes + 2  # + Describe and headroom
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="kv-recv"),
                             options=cfg.grpc_options(), maximum_concurrent_rpcs=slots)
        server.add_generic_rpc_handlers((frames.server_handler(self._push_blocks, self._describe),))
        port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls)
        if port == 0:
            raise OSError(f"KV receiver of worker {self.worker_id} could not listen on {cfg.host}:{cfg.port}")
        server.start()
        self._server = server
        self.address = f"{cfg.host}:{port}"
        self._reaper = threading.Thread(target=self._reap, name="kv-lease-reaper", daemon=True)
        self._reaper.start()
        log.info("KV receiver of worker %s listening on %s (backend %s)", self.worker_id, self.address, cfg.backend)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
        self._stop.set()
        self._wake.set()
        if self._reaper is not None:
            self._reaper.join()
        self.leases.stop(f"decode worker {self.worker_id} stopped its KV receiver")
        if self._mooncake is not None:
            self._mooncake.close()

    def __enter__(self) -> KVReceiver:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- owner API ------------------------------------------------------------------
    def expect(self, request_id: str, dest_block_ids: Sequence[int], block_hashes: Sequence[int],
               release_blocks: Callable[[list[int]], None], timeout: float | None = None) -> futures.Future:
        """Lease `dest_block_ids` (already allocated by the caller) to the transfer of
        `request_id`. The future resolves with a TransferOutcome; on failure the
        receiver calls release_blocks(dest_block_ids) once it is safe to reuse them."""
        bad = [b for b in dest_block_ids if not 0 <= int(b) < self.pool.num_blocks]
        if bad:
            raise ValueError(f"request {request_id!r}: blocks {bad[:8]} are outside the pool (0..{self.pool.num_blocks - 1})")
        fut = self.leases.expect(request_id, dest_block_ids, block_hashes, self.pool.spec.num_layers,
                                 timeout if timeout is not None else self.config.timeout_s, release_blocks)
        self._wake.set()
        return fut

    def abort(self, request_id: str, detail: str = "the request was aborted") -> bool:
        return self.leases.abort(request_id, f"{detail} (decode worker {self.worker_id})")

    def in_flight(self) -> dict[str, dict]:
        return self.leases.snapshot()

    def info(self) -> ReceiverInfo:
        spec = self.pool.spec
        return ReceiverInfo(epoch=self.epoch, num_blocks=self.pool.num_blocks, block_shape=list(spec.block_shape),
                            dtype=dtype_name(spec.dtype), block_nbytes=spec.block_nbytes,
                            mooncake_session=self._mooncake.session if self._mooncake else "",
                            pool_base=self.pool.data_ptr() if self._mooncake else 0)

    # ---- gRPC handlers --------------------------------------------------------------
    def _describe(self, request, context) -> pb.DescribeReply:
        return pb.DescribeReply(info=self.info().encode())

    def _push_blocks(self, stream, context) -> pb.PushAck:
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
        if problem is None and one_sided and self._mooncake is None:
            problem = "this decode worker's receiver does not run the mooncake backend (configure both ends alike)"
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
            bad = [(i, d, header.checksums[i]) for i, d in completed if d != header.checksums[i]]
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

    # ---- housekeeping -------------------------------------------------------------------
    def _reap(self) -> None:
        while not self._stop.is_set():
            wait = self.leases.tick()
            self._wake.wait(min(wait, 1.0))
            self._wake.clear()

    def _count_bytes(self, backend: str, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.kv_transfer_bytes.labels(backend=backend, direction="received").inc(nbytes)

    def _record_outcome(self, lease: Lease, result: R.TransferOutcome) -> None:
        backend = lease.backend or self.config.backend
        if result.ok:
            log.debug("request %r: %d KV bytes received in %.3fs", result.request_id, result.nbytes, result.seconds)
        else:
            log.warning("KV receiver %s: transfer for request %r failed (%s): %s; its %d blocks go back to the pool",
                        self.worker_id, result.request_id, result.reason, result.detail, len(lease.dest_block_ids))
        if self.metrics is None:
            return
        if result.ok:
            self.metrics.kv_transfer_seconds.labels(backend=backend).observe(result.seconds)
        else:
            self.metrics.kv_transfer_errors.labels(backend=backend, reason=result.reason).inc()


def _ack(request_id: str, status: str, detail: str, retry_allowed: bool = False,
         bytes_received: int = 0) -> pb.PushAck:
    return pb.PushAck(request_id=request_id, status=pb.PushStatus.Value(status), detail=detail,
                      retry_allowed=retry_allowed, bytes_received=bytes_received)
