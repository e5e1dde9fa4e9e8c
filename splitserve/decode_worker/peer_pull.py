"""Peer prefix pull, both ends, as decode workers run it.

The router sees in its index that another decode worker holds the prompt's first blocks
(device pool or offload tiers) and says so in the dispatch (GenerateRequest.pull_*). The
chosen worker then, before admitting the request: reserves blocks for the part of that
prefix it lacks, leases them to its own KV receiver, and asks the peer (PushPrefix) to push
its blocks there over the ordinary KV transfer, which verifies every block's hash and
checksum. Verified blocks join its prefix cache and the request is admitted as usual,
finding them there. Any failure (peer killed mid-push, checksum, timeout, no room) frees
the blocks once the receiver says no write can still land in them, and the prefix is
recomputed: token-exact either way. The peer pins the blocks it pushes, so they cannot be
evicted while they are read.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from splitserve.engine.async_engine import EngineDeadError
from splitserve.kvtransfer import KVTransferConfig, KVTransferError, create_sender
from splitserve.proto.convert import pb
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub

log = logging.getLogger(__name__)


class PeerPull:
    """DecodeWorker's peer pulls (it provides engine, an EngineHandle (engine/handle.py), and
    receiver, config, metrics, worker_id, kv_address, failed, draining and _prefill_channel)."""

    async def _pull_prefix(self, request: pb.GenerateRequest, prompt: list[int], params) -> int:
        """Pull the prefix blocks the router said a peer holds; how many arrived (0: recompute)."""
        bs = self.config.engine.block_size
        n = min(request.pull_blocks, (len(prompt) - 1) // bs)
        if n <= 0 or params.lora_name or self.receiver is None or not request.pull_address:
            return 0
        start = time.monotonic()
        rid = f"{request.request_id}/pull"
        reserved = await self.engine.reserve_pull(prompt[:n * bs])
        if reserved is None:
            self.metrics.kv_peer_pull_requests.labels(worker=self.worker_id, outcome="skipped").inc()
            return 0
        ids, hashes, parent, have = reserved
        loop = asyncio.get_running_loop()
        released = asyncio.Event()
        lease = self.receiver.expect(rid, ids, hashes, lambda _ids: loop.call_soon_threadsafe(released.set),
                                     timeout=self.config.prefill_timeout_s)
        try:
            await DecodeWorkerStub(self._prefill_channel(request.pull_address)).PushPrefix(
                pb.PushPrefixRequest(request_id=rid, prompt_token_ids=prompt[:n * bs], skip_blocks=have,
                                     kv_receiver_address=self.kv_address, kv_backend=self.config.kv_backend,
                                     dest_block_ids=ids, timeout_s=self.config.prefill_timeout_s),
                timeout=self.config.prefill_timeout_s, metadata=self.config.security.metadata)
            outcome = await asyncio.wrap_future(lease)
            if not outcome.ok:
                raise RuntimeError(f"KV transfer {outcome.reason}: {outcome.detail}")
            await self.engine.adopt_pulled(ids, hashes, parent)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            if isinstance(exc, EngineDeadError):
                raise
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("request %s: pulling %d prefix blocks from %s (%s) failed (%s); recomputing them on %s",
                        request.request_id, len(ids), request.pull_worker_id, request.pull_address, why,
                        self.worker_id)
            self.metrics.kv_peer_pull_requests.labels(worker=self.worker_id, outcome="failed").inc()
            await asyncio.shield(self._drop_pull(rid, lease, released, ids))
            return 0
        except BaseException:  # cancelled (client gone): free in the background, then go
            loop.create_task(self._drop_pull(rid, lease, released, ids))
            raise
        self.metrics.kv_peer_pull_requests.labels(worker=self.worker_id, outcome="ok").inc()
        self.metrics.kv_peer_pull_blocks.labels(worker=self.worker_id, direction="pulled").inc(len(ids))
        self.metrics.kv_peer_pull_seconds.labels(worker=self.worker_id).observe(time.monotonic() - start)
        return len(ids)

    async def _drop_pull(self, rid: str, lease, released: asyncio.Event, ids: list[int]) -> None:
        """Free a failed pull's blocks once no write can still land in them."""
        if not (lease.done() and lease.result().ok):
            self.receiver.abort(rid, "the peer pull failed")
            try:
                await asyncio.wait_for(released.wait(), timeout=self.config.prefill_timeout_s + 30)
            except TimeoutError:
                log.error("peer pull %s: the KV receiver never released its lease; freeing the blocks anyway", rid)
        if not self.failed:
            try:
                await self.engine.drop_pulled(ids)
            except EngineDeadError:
                pass

    async def PushPrefix(self, request: pb.PushPrefixRequest, context) -> pb.PushPrefixReply:  # noqa: N802
        """Peer side: push the prefix blocks held here into the caller's leased blocks."""
        if self.failed or self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id} is "
                                f"{'draining' if self.draining else 'failed'}")
        dest = list(request.dest_block_ids)
        try:
            pinned, hashes = await self.engine.pin_prefix(list(request.prompt_token_ids), request.skip_blocks)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id}: {exc}")
        try:
            if len(pinned) < len(dest):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"decode worker {self.worker_id} holds {len(pinned)} "
                                    f"of the {len(dest)} prefix blocks asked for (evicted since)")
            result = await asyncio.to_thread(
                self._peer_sender(request.kv_backend).push, request.request_id, request.kv_receiver_address,
                self.engine.kv_pool, pinned[:len(dest)], dest, hashes[:len(dest)], timeout=request.timeout_s or None)
        except KVTransferError as exc:
            log.warning("decode worker %s: peer push failed: %s", self.worker_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            try:
                await self.engine.unpin(pinned)
            except EngineDeadError:
                pass
        self.metrics.kv_peer_pull_blocks.labels(worker=self.worker_id, direction="pushed").inc(len(dest))
        return pb.PushPrefixReply(num_blocks=len(dest), kv_bytes=result.nbytes, kv_seconds=result.seconds)

    def _peer_sender(self, backend: str):
        senders = self.__dict__.setdefault("_peer_senders", {})
        if backend not in senders:
            cfg = KVTransferConfig(backend=backend, security=self.config.security,
                                   mooncake_protocol=self.config.kv_protocol,
                                   mooncake_device=self.config.rdma_device or "")
            senders[backend] = create_sender(backend, cfg, metrics=self.metrics)
        return senders[backend]

    def _close_peer_senders(self) -> None:
        for sender in self.__dict__.pop("_peer_senders", {}).values():
            sender.close()
