"""KVReceiver: the decode worker's end of KV transfer.

The decode worker allocates destination blocks, then calls expect() with them and a
release callback; the receiver serves PushBlocks on gRPC, writes (grpc backend) or
verifies (mooncake backend, whose bytes were written one-sided) the blocks, and
resolves the returned future with a TransferOutcome. On failure it hands the blocks
back through the callback exactly once, when nothing can still write into them.
The callback runs on a receiver thread: make it thread-safe (e.g. hop to your loop).
Each PushBlocks stream is handled by push_handler.PushHandler.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc

from splitserve.engine.kv_cache import KVCachePool
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.kvtransfer import frames
from splitserve.kvtransfer import outcome as R
from splitserve.kvtransfer.config import KVTransferConfig
from splitserve.kvtransfer.frames import pb
from splitserve.kvtransfer.lease import Lease, LeaseTable
from splitserve.kvtransfer.malloc_tuning import reuse_message_buffers
from splitserve.kvtransfer.mooncake_endpoint import MooncakeEndpoint
from splitserve.kvtransfer.push_handler import PushHandler
from splitserve.kvtransfer.segments import pool_regions, pool_segments
from splitserve.kvtransfer.stream_guard import StreamGuard
from splitserve.kvtransfer.wire import (
    ReceiverInfo,
    dtype_name,
)
from splitserve.metrics import Metrics

log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(self, pool: KVCachePool | ShardedKVPool, config: KVTransferConfig | None = None,
                 metrics: Metrics | None = None, worker_id: str = "decode"):
        self.pool = pool
        self.config = config or KVTransferConfig()
        self.metrics = metrics
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex
        self.leases = LeaseTable(self.config.max_attempts, self.config.one_sided_quarantine_s,
                                 on_outcome=self._record_outcome)
        self.streams = StreamGuard(self.config.max_pushes_per_peer, self.config.push_idle_timeout_s, worker_id)
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
            for region in pool_regions(self.pool):  # once, for the pool's lifetime: each rank's shard under TP
                self._mooncake.register(*region)
        slots = cfg.max_concurrent_pushes + 2  # + Describe and headroom
        server = cfg.security.sync_server(futures.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="kv-recv"),
                                          options=cfg.grpc_options(), maximum_concurrent_rpcs=slots)
        push = PushHandler(self.pool, self.leases, self.epoch, self._mooncake is not None, self.worker_id,
                           self._count_bytes, self.streams)
        server.add_generic_rpc_handlers((frames.server_handler(push, self._describe),))
        port = cfg.security.add_port(server, f"{cfg.host}:{cfg.port}")
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
        if self._mooncake is None:
            return ReceiverInfo(epoch=self.epoch, num_blocks=self.pool.num_blocks, block_shape=list(spec.block_shape),
                                dtype=dtype_name(spec.dtype), block_nbytes=spec.block_nbytes)
        segments = pool_segments(self.pool)
        one_rank = not isinstance(self.pool, ShardedKVPool)  # pool_base: what a sender without segments writes to
        return ReceiverInfo(epoch=self.epoch, num_blocks=self.pool.num_blocks, block_shape=list(spec.block_shape),
                            dtype=dtype_name(spec.dtype), block_nbytes=spec.block_nbytes,
                            mooncake_session=self._mooncake.session, pool_base=segments[0].base if one_rank else 0,
                            extra={"segments": [list(s) for s in segments]})

    # ---- gRPC handlers --------------------------------------------------------------
    def _describe(self, request, context) -> pb.DescribeReply:
        return pb.DescribeReply(info=self.info().encode())

    # ---- housekeeping -------------------------------------------------------------------
    def _reap(self) -> None:
        while not self._stop.is_set():
            wait = min(self.leases.tick(), self.streams.cancel_idle())
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
