"""Decode worker: receives KV from prefill workers (or prefills itself), runs continuous
batching, and streams tokens to the router over gRPC `Generate`.

Remote prefill, step by step: reserve the prompt's blocks (reusing this worker's
prefix cache), lease the new ones to the KV receiver, ask the prefill worker to
compute and push them, then admit the request with the first token it sampled.
Any failure on that path (prefill worker down, transfer error, timeout) releases
the lease and prefills locally instead: the client only sees a slower first token.
A failure of this worker's own engine ends its streams with UNAVAILABLE, which the
router answers by migrating them (worker_base/worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from splitserve.core.sampling_params import InvalidSamplingParams
from splitserve.engine.async_engine import EngineDeadError
from splitserve.engine.llm_engine import EngineStats, InvalidPromptError, RequestOutput
from splitserve.kvtransfer import KVReceiver, KVTransferConfig
from splitserve.metrics import Metrics
from splitserve.proto.convert import (
    logprob_from_proto,
    logprob_to_proto,
    pb,
    sampling_from_proto,
    sampling_to_proto,
)
from splitserve.proto.worker_pb2_grpc import (
    DecodeWorkerServicer,
    DecodeWorkerStub,
    PrefillWorkerStub,
    add_DecodeWorkerServicer_to_server,
)
from splitserve.worker_base.config import WorkerConfig
from splitserve.worker_base.worker import RECONNECT_OPTIONS, WorkerBase

log = logging.getLogger(__name__)


@dataclass
class DecodeWorkerConfig(WorkerConfig):
    prefill_timeout_s: float = 30.0
    drain_port: int | None = None  # /drain on 127.0.0.1 only (`splitserve drain`); 0: any free; None: off
    drain_timeout_s: float = 600.0

    role = "decode"


class EngineFailed:
    """Put on a stream's queue when the engine failed: the stream ends with UNAVAILABLE."""

    def __init__(self, reason: str):
        self.reason = reason


class DecodeWorker(WorkerBase, DecodeWorkerServicer):
    role = "decode"

    def __init__(self, config: DecodeWorkerConfig, metrics: Metrics | None = None, bus=None):
        super().__init__(config, metrics, bus)
        self.streams: dict[str, asyncio.Queue] = {}
        self._drain = None
        self.drain_port = 0
        self._prefill_channels: dict[str, grpc.aio.Channel] = {}
        self.receiver: KVReceiver | None = None
        self._leased: set[str] = set()  # remote prefills whose KV lease may still be open

    async def start(self) -> str:
        cfg = self.config
        if cfg.admin_port is not None:
            from splitserve.worker_base.admin import admin_app

            await self._start_admin(admin_app(self))
        if cfg.drain_port is not None:  # loopback only: nothing outside the pod may drain it
            from splitserve.decode_worker.admin import drain_app
            from splitserve.worker_base.admin import start_admin

            self._drain, self.drain_port = await start_admin(drain_app(self, cfg.drain_timeout_s), "127.0.0.1",
                                                             cfg.drain_port)
        engine = await self._start_engine()
        self.receiver = KVReceiver(engine.runner.kv_pool, KVTransferConfig(
            backend=cfg.kv_backend, host=cfg.host, mooncake_protocol=cfg.kv_protocol,
            mooncake_device=cfg.rdma_device or "", security=cfg.security), metrics=self.metrics,
            worker_id=self.worker_id)
        kv_port = (await asyncio.to_thread(self.receiver.start)).rsplit(":", 1)[1]
        self.server = self._server(options=[("grpc.max_receive_message_length", 64 << 20)])
        add_DecodeWorkerServicer_to_server(self, self.server)
        await self._bind(self.server)
        self.kv_address = f"{self.address.rsplit(':', 1)[0]}:{kv_port}"  # what prefill workers dial
        await self._start_presence(engine)
        log.info("decode worker %s serving on %s (KV receiver %s, %d blocks%s; links: %s)", self.worker_id,
                 self.address, self.kv_address, engine.num_total_blocks,
                 f", admin {self.admin_url}" if self.admin_url else "", cfg.security.describe())
        return self.address

    async def stop(self) -> None:
        if self.presence is not None:
            await self.presence.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        for channel in self._prefill_channels.values():
            await channel.close()
        if self.receiver is not None:
            self.receiver.stop()
        await self._stop_common()
        if self._drain is not None:
            await self._drain.cleanup()

    # ---- state ------------------------------------------------------------------------
    def _load_numbers(self, s: EngineStats) -> tuple[int, int]:
        return s.waiting + s.remote_prefills, s.queued_prompt_tokens

    def _kv_extras(self, s: EngineStats) -> dict:
        return {"remote_prefills": s.remote_prefills,
                "kv_leases": len(self.receiver.in_flight()) if self.receiver is not None else 0}

    def admin_extras(self) -> dict:
        return {"streams": len(self.streams)}

    def _health_stub(self, channel):
        return DecodeWorkerStub(channel)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self.streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _in_flight(self) -> list[str]:
        return sorted(self.streams)

    def _fail_in_flight(self, reason: str) -> None:
        for q in self.streams.values():
            q.put_nowait(EngineFailed(reason))

    # ---- gRPC -------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):  # noqa: N802 - gRPC name
        rid = request.request_id
        if self.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id}: {self.failed}")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.worker_id} is draining")
        if not rid or rid in self.streams:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or in use")
        try:
            params = sampling_from_proto(request.sampling)
        except InvalidSamplingParams as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
        resume = list(request.resume_token_ids)
        if resume and params.max_tokens is not None:
            params.max_tokens = max(1, params.max_tokens - len(resume))
        prompt = list(request.prompt_token_ids) + resume
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        fallback = ""
        prefill_cached = 0
        prefill_worker = self.worker_id
        engine = self.engine.engine
        try:
            first: RequestOutput | None = None
            if request.prefill_address and resume and params.seed is not None and not params.greedy:
                fallback = "a migrated seeded request is prefilled here (the prefill worker cannot resume its RNG)"
            elif request.prefill_address:
                first, fallback, prefill_cached = await self._remote_prefill(request, prompt, params, len(resume))
                if first is not None:
                    prefill_worker = request.prefill_worker_id
            if first is None:
                await self.engine.call(engine.add_request, rid, prompt, params, False, len(resume))
            header = True
            while True:
                out = first if first is not None else await queue.get()
                first = None
                if isinstance(out, EngineFailed):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: {out.reason}")
                if out.error is not None:  # a failed engine step: the router retries elsewhere
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"request {rid}: decode worker {self.worker_id}: {out.error}")
                chunk = pb.GenerateChunk(token_ids=out.new_token_ids, finish_reason=out.finish_reason or "",
                                         logprobs=[logprob_to_proto(lp) for lp in out.new_logprobs])
                if header:
                    chunk.num_prompt_tokens = len(request.prompt_token_ids)
                    chunk.num_cached_tokens = out.num_cached_tokens
                    chunk.worker_id, chunk.prefill_worker_id = self.worker_id, prefill_worker
                    chunk.prefill_fallback, chunk.prefill_cached_tokens = fallback, prefill_cached
                    header = False
                yield chunk
                if out.finished:
                    finished = True
                    return
        except InvalidPromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: decode worker {self.worker_id}: {exc}")
        finally:
            self.streams.pop(rid, None)
            if not finished:  # the router went away (client disconnect, migration, abort)
                # Shielded: a second cancellation of this handler must not skip the abort.
                await asyncio.shield(asyncio.ensure_future(self._abort(rid)))

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:  # noqa: N802
        return pb.AbortReply(found=await self._abort(request.request_id))

    async def Health(self, request, context) -> pb.HealthReply:  # noqa: N802
        r = self.load_report()
        return pb.HealthReply(worker_id=self.worker_id, role="decode", draining=self.draining,
                              running=r.running, waiting=r.waiting, kv_usage=r.kv_usage)

    async def _abort(self, rid: str) -> bool:
        self.receiver.abort(rid)
        if self.failed:  # a dead or stalled engine cannot free anything; the process is replaced
            return False
        engine = self.engine.engine
        leased = rid in self._leased  # a remote prefill's blocks wait for its lease to be released
        try:
            return bool(await self.engine.call(lambda: engine.abort(rid) or (rid in engine.remote and (
                leased or engine.cancel_remote_prefill(rid) or True))))
        except EngineDeadError:
            return False  # nothing left to free: the process is about to be replaced

    # ---- remote prefill -----------------------------------------------------------------
    def _prefill_channel(self, address: str) -> grpc.aio.Channel:
        # One channel per prefill worker: with mTLS a handshake per request would cost more than the RPC.
        if address not in self._prefill_channels:
            self._prefill_channels[address] = self.config.security.aio_channel(address, RECONNECT_OPTIONS)
        return self._prefill_channels[address]

    async def _remote_prefill(self, request: pb.GenerateRequest, prompt: list[int], params,
                              draws_done: int) -> tuple[RequestOutput | None, str, int]:
        """(first output, "", prefill worker's cached tokens) on success; (None, why, 0) when
        the caller should prefill locally."""
        rid, engine = request.request_id, self.engine.engine
        seq = await self.engine.call(engine.reserve_remote_prefill, rid, prompt, params, draws_done)
        if seq is None:
            return None, "no free KV blocks for the whole prompt yet", 0
        skip = seq.num_cached_tokens // self.config.engine.block_size
        dest, hashes = await self.engine.call(engine.remote_prefill_blocks, seq, skip)
        released = asyncio.Event()
        loop = asyncio.get_running_loop()
        lease = self.receiver.expect(rid, dest, hashes, lambda _ids: loop.call_soon_threadsafe(released.set),
                                     timeout=self.config.prefill_timeout_s) if dest else None
        if lease is not None:
            self._leased.add(rid)  # its blocks are freed by _release_reservation, never by _abort
        try:
            reply = await PrefillWorkerStub(self._prefill_channel(request.prefill_address)).Prefill(
                pb.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
                    kv_receiver_address=self.kv_address, kv_backend=self.config.kv_backend, skip_blocks=skip,
                    dest_block_ids=dest, timeout_s=self.config.prefill_timeout_s,
                ), timeout=self.config.prefill_timeout_s, metadata=self.config.security.metadata)
            if lease is not None:
                outcome = await asyncio.wrap_future(lease)
                if not outcome.ok:
                    raise RuntimeError(f"KV transfer {outcome.reason}: {outcome.detail}")
            lp = logprob_from_proto(reply.first_logprob) if reply.has_logprob else None
            first = await self.engine.call(engine.complete_remote_prefill, rid, reply.first_token_id, lp)
            self._leased.discard(rid)  # the blocks belong to the running request now
            return first, "", reply.num_cached_tokens
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            if isinstance(exc, EngineDeadError):
                raise
            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("request %s: remote prefill on %s (%s) failed (%s); prefilling locally on %s",
                        rid, request.prefill_worker_id, request.prefill_address, why, self.worker_id)
            self.metrics.local_prefill_fallbacks.labels(worker=self.worker_id, reason=_reason(exc)).inc()
            # Shielded: a client that leaves now must not skip the wait for the lease.
            await asyncio.shield(self._release_reservation(rid, lease, released, "remote prefill failed"))
            return None, why, 0
        except BaseException:  # cancelled (client gone): free in the background, then go
            loop.create_task(self._release_reservation(rid, lease, released, "the request was cancelled"))
            raise

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
                    await self.engine.call(self.engine.engine.cancel_remote_prefill, rid)
                except EngineDeadError:
                    pass  # nothing left to free: the process is about to be replaced

    # ---- draining ------------------------------------------------------------------------
    async def drain(self, timeout: float = 600.0) -> bool:
        """Stop admitting (routers see it draining), let every stream finish, then leave the
        registry; streams still open at the deadline are migrated by the routers."""
        self.draining = True
        if self.presence is not None:
            await self.presence.announce_draining()
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.presence is not None:
            await self.presence.hide()
        return not self.streams


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name.lower()
    return "kv_transfer"
