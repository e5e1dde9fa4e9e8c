"""Decode worker: receives KV from prefill workers (or prefills itself, see
remote_prefill.py), runs continuous batching, and streams tokens to the router over
gRPC `Generate`. A failure of this worker's own engine ends its streams with UNAVAILABLE, which the
router answers by migrating them (worker_base/worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from splitserve.core import tracing
from splitserve.core.sampling_params import InvalidSamplingParams
from splitserve.decode_worker.peer_pull import PeerPull
from splitserve.decode_worker.prefill_timeout import DEFAULT_PREFILL_TIMEOUT_S
from splitserve.decode_worker.remote_prefill import RemotePrefill
from splitserve.engine.async_engine import EngineDeadError
from splitserve.engine.intake import UnknownModelError
from splitserve.engine.llm_engine import InvalidPromptError, RequestOutput
from splitserve.engine.stats import EngineStats
from splitserve.kvtransfer import KVReceiver, KVTransferConfig
from splitserve.metrics import Metrics
from splitserve.proto.convert import (
    logprob_to_proto,
    pb,
    sampling_from_proto,
)
from splitserve.proto.worker_pb2_grpc import (
    DecodeWorkerServicer,
    DecodeWorkerStub,
    add_DecodeWorkerServicer_to_server,
)
from splitserve.worker_base.config import WorkerConfig
from splitserve.worker_base.lora_service import LoRAService
from splitserve.worker_base.worker import WorkerBase

log = logging.getLogger(__name__)

@dataclass
class DecodeWorkerConfig(WorkerConfig):
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S  # --prefill-timeout
    drain_port: int | None = None  # /drain on 127.0.0.1 only (`splitserve drain`); 0: any free; None: off
    drain_timeout_s: float = 600.0

    role = "decode"


class EngineFailed:
    """Put on a stream's queue when the engine failed: the stream ends with UNAVAILABLE."""

    def __init__(self, reason: str):
        self.reason = reason


class DecodeWorker(RemotePrefill, PeerPull, LoRAService, WorkerBase, DecodeWorkerServicer):
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
        # tensor-parallel: the pool is every rank's heads (engine/parallel/kv_shards.py)
        self.receiver = KVReceiver(engine.kv_pool, KVTransferConfig(
            backend=cfg.kv_backend, host=cfg.host, mooncake_protocol=cfg.kv_protocol,
            mooncake_device=cfg.rdma_device or "", security=cfg.security), metrics=self.metrics,
            worker_id=self.worker_id)
        kv_port = (await asyncio.to_thread(self.receiver.start)).rsplit(":", 1)[1]
        self.server = self._server(options=[("grpc.max_receive_message_length", 64 << 20)])
        add_DecodeWorkerServicer_to_server(self, self.server)
        await self._bind(self.server)
        self.kv_address = f"{self.address.rsplit(':', 1)[0]}:{kv_port}"  # prefill workers dial it
        await self._start_presence(engine)
        log.info("decode worker %s serving on %s (KV receiver %s, %s%s; links: %s)", self.worker_id,
                 self.address, self.kv_address, self.kv_pool_description(),
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
        self._close_peer_senders()
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

    def _stream_failure(self, rid: str, out) -> str | None:
        """Why a stream's next item ends it: the engine gone, or a failed step; else None."""
        if isinstance(out, EngineFailed):
            return f"request {rid}: {out.reason}"
        if out.error is not None:
            return f"request {rid}: decode worker {self.worker_id}: {out.error}"
        return None

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
        params = params.resumed(len(resume))
        if params is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {len(resume)} tokens to resume "
                                f"leave nothing of max_tokens {request.sampling.max_tokens}")
        prompt = list(request.prompt_token_ids) + resume
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        fallback = ""
        prefill_cached = 0
        prefill_worker = self.worker_id
        span = decode_span = tracing.start("decode_worker.generate", tracing.extract_grpc(context),
                                           "server", {**tracing.request_attributes(self.config.engine.model_id,
                                                                                   params, len(prompt)),
                                                      "gen_ai.response.id": rid, "splitserve.worker": self.worker_id,
                                                      "splitserve.resumed_tokens": len(resume)})
        if tracing.enabled():
            self.trace_spans[rid] = span
        produced = 0
        try:
            first: RequestOutput | None = None
            if request.pull_blocks and not resume:  # a peer holds the prefix: pulled, not recomputed
                await self._pull_prefix(request, prompt, params)
            if request.prefill_address and resume and params.seed is not None and not params.greedy:
                fallback = "a migrated seeded request is prefilled here (the prefill worker cannot resume its RNG)"
            elif request.prefill_address and resume and params.structured is not None:
                fallback = "a migrated constrained request is prefilled here (its grammar state is rebuilt here)"
            elif request.prefill_address and resume and (params.presence_penalty or params.frequency_penalty):
                fallback = ("a migrated request with presence/frequency penalties is prefilled here (the prefill "
                            "worker would count its earlier output as prompt)")
            elif request.prefill_address:
                first, fallback, prefill_cached = await self._remote_prefill(request, prompt, params, len(resume))
                if first is not None:
                    prefill_worker = request.prefill_worker_id
            if first is None:
                self.handed_to_engine(len(prompt))
                await self.engine.add_request(rid, prompt, params, num_draws_done=len(resume))
            header = True
            held = pb.GenerateChunk()  # tokens held back until the stream interval is reached
            interval = max(1, request.stream_interval)
            while True:
                out = first if first is not None else await queue.get()
                first = None
                while True:
                    failure = self._stream_failure(rid, out)
                    if failure is not None:
                        break
                    last = out
                    held.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs:
                        held.logprobs.extend(logprob_to_proto(lp) for lp in out.new_logprobs)
                    # Steps that finished while this stream was still sending go out in the same
                    # message, as vLLM merges outputs its consumer has not taken yet: under load the
                    # serving path then spends per message, not per token; otherwise nothing changes.
                    if out.finished or queue.empty():
                        break
                    out = queue.get_nowait()
                if failure is None and not (header or out.finished or len(held.token_ids) >= interval):
                    continue
                # Tokens made before a failure still go out first (merged, or held for the stream
                # interval): the router resumes after them, not from the start.
                if failure is None or held.token_ids:
                    chunk, held = held, pb.GenerateChunk()
                    chunk.finish_reason = (out.finish_reason or "") if failure is None else ""
                    produced += len(chunk.token_ids)
                    if header and tracing.enabled():  # decode: from the first token to the finish
                        decode_span = tracing.start("decode", span, attributes={"splitserve.worker": self.worker_id})
                    if header:
                        chunk.num_prompt_tokens = len(request.prompt_token_ids)
                        chunk.num_cached_tokens = last.num_cached_tokens
                        chunk.worker_id, chunk.prefill_worker_id = self.worker_id, prefill_worker
                        chunk.prefill_fallback, chunk.prefill_cached_tokens = fallback, prefill_cached
                        header = False
                    yield chunk
                if failure is not None:  # the router retries elsewhere
                    await context.abort(grpc.StatusCode.UNAVAILABLE, failure)
                if out.finished:
                    finished = True
                    span.set_attributes({"gen_ai.usage.output_tokens": produced,
                                         "gen_ai.response.finish_reasons": [out.finish_reason or ""],
                                         "splitserve.prefill_worker": prefill_worker,
                                         "splitserve.prefill_fallback": fallback})
                    return
        except UnknownModelError as exc:  # its adapter is not (or no longer) loaded: the router's 404
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {rid}: {exc}")
        except InvalidPromptError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: decode worker {self.worker_id}: {exc}")
        finally:
            self.streams.pop(rid, None)
            self.trace_spans.pop(rid, None)
            for s in {decode_span, span}:
                if not finished:
                    tracing.fail(s, RuntimeError("the stream ended early (router gone, migration, abort, failure)"))
                s.end()
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
        if self.receiver is not None:
            self.receiver.abort(rid)
        if self.failed:  # a dead or stalled engine cannot free anything; the process is replaced
            return False
        leased = rid in self._leased  # a remote prefill's blocks wait for its lease to be released
        try:
            return await self.engine.abort(rid, free_reservation=not leased)
        except EngineDeadError:
            return False  # nothing left to free: the process is about to be replaced

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
