"""Prefill worker: computes a prompt's KV (reusing its own prefix cache), pushes the
blocks the decode worker lacks straight into that worker's destination blocks,
and answers with the first token, sampled with the request's parameters.

The blocks stay referenced from the end of the forward pass until the push is
verified or has failed, so nothing can overwrite them mid-transfer.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from dataclasses import dataclass, field, replace

import grpc

from splitserve.cluster.messages import LoadReport, WorkerInfo
from splitserve.cluster.presence import WorkerPresence, advertised_host
from splitserve.cluster.remote_bus import open_bus
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import InvalidPromptError, LLMEngine, RequestOutput
from splitserve.engine.sampling_params import InvalidSamplingParams
from splitserve.kvtransfer import BACKENDS, KVTransferConfig, KVTransferError, create_sender
from splitserve.metrics import Metrics
from splitserve.proto.convert import logprob_to_proto, pb, sampling_from_proto
from splitserve.proto.worker_pb2_grpc import (
    PrefillWorkerServicer,
    add_PrefillWorkerServicer_to_server,
)
from splitserve.security.tls import TLSConfig, add_port

log = logging.getLogger(__name__)

MAX_PUSH_TIMEOUT_S = 600.0


@dataclass
class PrefillWorkerConfig:
    engine: EngineConfig
    worker_id: str = field(default_factory=lambda: f"prefill-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    bus_url: str | None = None
    cluster: str = "local"
    heartbeat_ttl_s: float = 6.0
    metrics_port: int | None = None  # GET /metrics and /health; 0: any free port; None: off
    tls: TLSConfig | None = None  # mutual TLS on its gRPC server and its KV pushes
    kv_protocol: str = "tcp"  # mooncake transport: tcp | rdma
    rdma_device: str | None = None


class PrefillWorker(PrefillWorkerServicer):
    def __init__(self, config: PrefillWorkerConfig, metrics: Metrics | None = None, bus=None):
        self.config = config
        self._given_bus = bus  # tests and `splitserve serve` may share one bus object
        self.worker_id = config.worker_id
        self.metrics = metrics or Metrics()
        self.waiters: dict[str, asyncio.Future[RequestOutput]] = {}
        self.senders: dict[str, object] = {}
        self.address = ""

    async def start(self) -> str:
        cfg = self.config
        engine = await asyncio.to_thread(LLMEngine, cfg.engine)
        self.engine = AsyncEngine(engine, asyncio.get_running_loop(), self._dispatch, self._on_block_events)
        self.engine.start()
        self.server = grpc.aio.server()
        add_PrefillWorkerServicer_to_server(self, self.server)
        port = add_port(self.server, f"{cfg.host}:{cfg.port}", cfg.tls)
        await self.server.start()
        self.address = f"{advertised_host(cfg.host, cfg.advertise_host)}:{port}"
        self.bus = self._given_bus or open_bus(cfg.bus_url, cfg.cluster, cfg.tls)
        info = WorkerInfo(self.worker_id, "prefill", self.address, engine.model_id, cfg.engine.block_size,
                          engine.num_total_blocks)
        self.presence = WorkerPresence(self.bus, info, self.load_report, ttl=cfg.heartbeat_ttl_s,
                                       cached_blocks=self._cached_blocks)
        await self.presence.start()
        self.metrics_url = ""
        if cfg.metrics_port is not None:
            await self._serve_metrics(cfg.metrics_port)
        log.info("prefill worker %s serving on %s (%d KV blocks)", self.worker_id, self.address,
                 engine.num_total_blocks)
        return self.address

    async def _serve_metrics(self, port: int) -> None:
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        async def metrics(request):
            return web.Response(body=generate_latest(self.metrics.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def health(request):
            return web.json_response({"status": "ok", "worker_id": self.worker_id, "kv": self.kv_state()})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        from splitserve.decode_worker.admin import start_admin

        self._admin, bound = await start_admin(app, self.config.host, port)
        self.metrics_url = f"http://{advertised_host(self.config.host, self.config.advertise_host)}:{bound}"

    async def stop(self) -> None:
        if getattr(self, "_admin", None) is not None:
            await self._admin.cleanup()
        await self.presence.stop()
        await self.server.stop(grace=1.0)
        for sender in self.senders.values():
            sender.close()
        self.engine.stop()
        if self._given_bus is None:
            await self.bus.close()

    def kv_state(self) -> dict:
        """Block accounting for /health: after every prefill has ended, free == total."""
        e = self.engine.engine
        return {"free_blocks": e.num_free_blocks, "total_blocks": e.num_total_blocks, "sequences": len(e.sequences),
                "held_for_push": len(e.held), "waiters": len(self.waiters)}

    def load_report(self) -> LoadReport:
        e = self.engine.engine
        waiting = list(e.scheduler.waiting) + [s for s in e.scheduler.running if s.num_computed_tokens < s.num_tokens]
        queued_tokens = sum(s.num_tokens - s.num_computed_tokens for s in waiting)
        usage = e.block_manager.usage
        sched = e.scheduler
        self.metrics.sync_engine_counters("prefill", self.worker_id, sched.prefix_query_tokens, sched.prefix_hit_tokens,
                                          sched.num_preemptions)
        labels = {"role": "prefill", "worker": self.worker_id}
        self.metrics.num_requests_waiting.labels(**labels).set(len(e.scheduler.waiting))
        self.metrics.num_requests_running.labels(**labels).set(len(e.scheduler.running))
        self.metrics.kv_cache_usage.labels(**labels).set(usage)
        return LoadReport(self.worker_id, "prefill", len(e.scheduler.waiting), len(e.scheduler.running), usage,
                          waiting_tokens=queued_tokens)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            fut = self.waiters.get(out.request_id)
            if fut is not None and out.finished and not fut.done():
                fut.set_result(out)

    async def _cached_blocks(self) -> list[int]:
        bm = self.engine.engine.block_manager
        return await self.engine.call(lambda: list(bm.hash_to_block))

    def _on_block_events(self, events) -> None:
        self.presence.publish_block_events(events)

    def _sender(self, backend: str):
        if backend not in self.senders:
            cfg = KVTransferConfig(backend=backend, tls=self.config.tls, mooncake_protocol=self.config.kv_protocol,
                                   mooncake_device=self.config.rdma_device or "")
            self.senders[backend] = create_sender(backend, cfg, metrics=self.metrics)
        return self.senders[backend]

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:  # noqa: N802
        rid, engine = request.request_id, self.engine.engine
        if not rid or rid in self.waiters:  # never touch another caller's request
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or in use")
        if not 0 <= request.timeout_s <= MAX_PUSH_TIMEOUT_S:  # also rejects NaN
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request {rid}: timeout_s {request.timeout_s} is not in [0, {MAX_PUSH_TIMEOUT_S}]")
        if request.kv_backend not in BACKENDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request {rid}: kv_backend {request.kv_backend!r} is not one of {BACKENDS}")
        try:
            params = replace(sampling_from_proto(request.sampling), max_tokens=1, stop=[], n=1)
        except InvalidSamplingParams as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
        fut: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.waiters[rid] = fut
        try:
            try:
                await self.engine.call(engine.add_request, rid, list(request.prompt_token_ids), params, True)
            except (InvalidPromptError, ValueError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
            first = await fut
            if first.finish_reason == "abort":
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid}: aborted on {self.worker_id}")
            seq = engine.held[rid]
            src, hashes = await self.engine.call(engine.remote_prefill_blocks, seq, request.skip_blocks)
            if len(src) != len(request.dest_block_ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request {rid}: {len(request.dest_block_ids)} destination blocks for "
                                    f"{len(src)} prompt blocks after skipping {request.skip_blocks}")
            result = None
            if src:
                result = await asyncio.to_thread(
                    self._sender(request.kv_backend).push, rid, request.kv_receiver_address,
                    engine.runner.kv_pool, src, list(request.dest_block_ids), hashes,
                    timeout=request.timeout_s or None)
        except KVTransferError as exc:
            log.warning("prefill worker %s: %s", self.worker_id, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            self.waiters.pop(rid, None)
            # Shielded: a second cancellation of this handler must not leave the blocks held.
            await asyncio.shield(asyncio.ensure_future(self._release(rid, abort=not fut.done())))
        reply = pb.PrefillReply(first_token_id=first.token_ids[0], num_cached_tokens=first.num_cached_tokens,
                                worker_id=self.worker_id)
        if first.logprobs:
            reply.first_logprob.CopyFrom(logprob_to_proto(first.logprobs[0]))
            reply.has_logprob = True
        if result is not None:
            reply.kv_bytes, reply.kv_seconds = result.nbytes, result.seconds
        return reply

    async def _release(self, rid: str, abort: bool) -> None:
        engine = self.engine.engine
        if abort:  # the caller went away before the prefill finished
            await self.engine.call(engine.abort, rid)
        await self.engine.call(engine.release_held, rid)

    async def Health(self, request, context) -> pb.HealthReply:  # noqa: N802
        r = self.load_report()
        return pb.HealthReply(worker_id=self.worker_id, role="prefill", running=r.running, waiting=r.waiting,
                              kv_usage=r.kv_usage)
