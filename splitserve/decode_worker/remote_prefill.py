"""Remote prefill, as the decode worker runs it.

Step by step: reserve the prompt's blocks (reusing this worker's prefix cache), lease the
new ones to the KV receiver, ask the prefill worker to compute and push them, then admit
the request with the first token it sampled. Any failure on that path (prefill worker
down, transfer error, timeout) releases the lease and prefills locally instead: the
client only sees a slower first token. Blocks under a lease are freed only once the
receiver says no write can still land in them.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from splitserve.core import tracing
from splitserve.engine.async_engine import EngineDeadError
from splitserve.engine.llm_engine import RequestOutput
from splitserve.proto.convert import logprob_from_proto, pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import PrefillWorkerStub
from splitserve.worker_base.worker import RECONNECT_OPTIONS

log = logging.getLogger(__name__)


class RemotePrefill:
    """DecodeWorker's remote prefill (it provides engine, receiver, config, metrics,
    worker_id, kv_address, failed, _leased and _prefill_channels)."""

    def _prefill_channel(self, address: str) -> grpc.aio.Channel:
        # One channel per prefill worker: with mTLS a handshake per request would cost more than the RPC.
        if address not in self._prefill_channels:
            self._prefill_channels[address] = self.config.security.aio_channel(address, RECONNECT_OPTIONS)
        return self._prefill_channels[address]

    async def _remote_prefill(self, request: pb.GenerateRequest, prompt: list[int], params,
                              draws_done: int) -> tuple[RequestOutput | None, str, int]:
        """(first output, "", prefill worker's cached tokens) on success; (None, why, 0) when
        the caller should prefill locally."""
        rid = request.request_id
        slot = await self.engine.reserve_remote_prefill(rid, prompt, params, draws_done)
        if slot is None:
            return None, "no free KV blocks for the whole prompt (or LoRA slot: --max-loras) yet", 0
        skip, dest, hashes = slot.skip_blocks, slot.block_ids, slot.block_hashes
        released = asyncio.Event()
        loop = asyncio.get_running_loop()
        lease = self.receiver.expect(rid, dest, hashes, lambda _ids: loop.call_soon_threadsafe(released.set),
                                     timeout=self.config.prefill_timeout_s) if dest else None
        if lease is not None:
            self._leased.add(rid)  # its blocks are freed by _release_reservation, never by _abort
        span = tracing.start("remote_prefill", self.trace_spans.get(rid), "client", {
            "splitserve.prefill_worker": request.prefill_worker_id, "splitserve.kv.backend": self.config.kv_backend,
            "splitserve.kv.blocks": len(dest), "splitserve.kv.skip_blocks": skip})
        try:
            reply = await PrefillWorkerStub(self._prefill_channel(request.prefill_address)).Prefill(
                pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
                    kv_receiver_address=self.kv_address, kv_backend=self.config.kv_backend, skip_blocks=skip,
                    dest_block_ids=dest, timeout_s=self.config.prefill_timeout_s,
                ), timeout=self.config.prefill_timeout_s, metadata=tracing.inject(self.config.security.metadata, span))
            if lease is not None:
                outcome = await asyncio.wrap_future(lease)
                if not outcome.ok:
                    raise RuntimeError(f"KV transfer {outcome.reason}: {outcome.detail}")
            span.set_attributes({"splitserve.kv.bytes": reply.kv_bytes, "splitserve.kv.seconds": reply.kv_seconds,
                                 "splitserve.prefill_cached_tokens": reply.num_cached_tokens})
            lp = logprob_from_proto(reply.first_logprob) if reply.has_logprob else None
            first = await self.engine.complete_remote_prefill(rid, reply.first_token_id, lp)
            self._leased.discard(rid)  # the blocks belong to the running request now
            return first, "", reply.num_cached_tokens
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            if isinstance(exc, EngineDeadError):
                raise
            rpc = isinstance(exc, grpc.aio.AioRpcError)
            why = f"{exc.code().name}: {exc.details()}" if rpc else str(exc)
            # RESOURCE_EXHAUSTED: refused up front, its queue too deep for the deadline (load, not a fault)
            refused = rpc and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            log.log(logging.INFO if refused else logging.WARNING,
                    "request %s: remote prefill on %s (%s) %s (%s); prefilling locally on %s", rid,
                    request.prefill_worker_id, request.prefill_address, "refused" if refused else "failed", why,
                    self.worker_id)
            self.metrics.local_prefill_fallbacks.labels(worker=self.worker_id, reason=_reason(exc)).inc()
            tracing.fail(span, exc)
            # Shielded: a client that leaves now must not skip the wait for the lease.
            await asyncio.shield(self._release_reservation(rid, lease, released, "remote prefill failed"))
            return None, why, 0
        except BaseException as exc:  # cancelled (client gone): free in the background, then go
            tracing.fail(span, exc)
            loop.create_task(self._release_reservation(rid, lease, released, "the request was cancelled"))
            raise
        finally:
            span.end()

    async def _release_reservation(self, rid: str, lease, released: asyncio.Event, why: str) -> None:
        """Free a remote prefill's reserved blocks, once the receiver says no write can still
        land in them (one-sided writes cannot be recalled): after its lease succeeded, or
        after it failed and released them."""
        try:
            if lease is not None and not (lease.done() and lease.result().ok):
                self.receiver.abort(rid, why)
                try:
                    await asyncio.wait_for(released.wait(), timeout=self.config.prefill_timeout_s + 30)
                except TimeoutError:
                    log.error("request %s: the KV receiver of %s never released its lease; freeing the blocks "
                              "anyway", rid, self.worker_id)
        finally:
            self._leased.discard(rid)
            if not self.failed:
                try:
                    await self.engine.cancel_remote_prefill(rid)
                except EngineDeadError:
                    pass  # nothing left to free: the process is about to be replaced


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name.lower()
    return "kv_transfer"
