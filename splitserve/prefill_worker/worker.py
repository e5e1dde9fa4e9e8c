"""Prefill worker: computes a prompt's KV (reusing its own prefix cache), pushes the
blocks the decode worker lacks straight into that worker's destination blocks,
and answers with the first token, sampled with the request's parameters.

The blocks stay referenced from the end of the forward pass until the push is
verified or has failed, so nothing can overwrite them mid-transfer. A failure of the
engine answers UNAVAILABLE, and the decode worker prefills locally instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import grpc

from splitserve.core import tracing
from splitserve.core.sampling_params import InvalidSamplingParams
from splitserve.engine.async_engine import EngineDeadError
from splitserve.engine.llm_engine import InvalidPromptError, RequestOutput
from splitserve.engine.stats import EngineStats
from splitserve.kvtransfer import BACKENDS, KVTransferConfig, KVTransferError, create_sender
from splitserve.metrics import Metrics
from splitserve.prefill_worker.admission import PrefillThroughput
from splitserve.proto.convert import logprob_to_proto, pb, sampling_from_proto
from splitserve.proto.worker_pb2_grpc import (
    PrefillWorkerServicer,
    PrefillWorkerStub,
    add_PrefillWorkerServicer_to_server,
)
from splitserve.worker_base.config import WorkerConfig
from splitserve.worker_base.lora_service import LoRAService
from splitserve.worker_base.worker import WorkerBase

log = logging.getLogger(__name__)

MAX_PUSH_TIMEOUT_S = 600.0
HELD_SWEEP_S = 5.0  # how often held blocks are counted (the gauge) and checked for an owner
ORPHAN_GRACE_S = 10.0  # held with no Prefill call left to push them for this long: released


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    role = "prefill"


class PrefillWorker(LoRAService, WorkerBase, PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, config: PrefillWorkerConfig, metrics: Metrics | None = None, bus=None):
        super().__init__(config, metrics, bus)
        self.waiters: dict[str, asyncio.Future[RequestOutput]] = {}
        self.senders: dict[str, object] = {}
        # admission: refuse what cannot meet its deadline (admission.py)
        self.throughput = PrefillThroughput(blind_tokens=config.engine.max_num_batched_tokens)
        self.orphans: dict[str, float] = {}  # held requests no call owns, since when (monotonic)
        self.held_expired = 0  # holds the sweep released: each one a bug (/health, tests' pool invariant)
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> str:
        cfg = self.config
        if cfg.admin_port is not None:
            from splitserve.worker_base.admin import admin_app

            await self._start_admin(admin_app(self))
        engine = await self._start_engine()
        self.server = self._server()
        add_PrefillWorkerServicer_to_server(self, self.server)
        await self._bind(self.server)
        await self._start_presence(engine)
        self.metrics.kv_held_blocks.labels(role=self.role, worker=self.worker_id).set_function(
            lambda: self.engine.stats.held_blocks)  # as of the last step, read at scrape time
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_held())
        log.info("prefill worker %s serving on %s (%s%s; links: %s)", self.worker_id, self.address,
                 self.kv_pool_description(), f", admin {self.admin_url}" if self.admin_url else "",
                 cfg.security.describe())
        return self.address

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.presence is not None:
            await self.presence.stop()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        for sender in self.senders.values():
            sender.close()
        await self._stop_common()

    # ---- state ------------------------------------------------------------------------
    def _kv_extras(self, s: EngineStats) -> dict:
        return {"held_for_push": s.held_for_push, "held_blocks": s.held_blocks, "waiters": len(self.waiters),
                "held_expired": self.held_expired}

    def admin_extras(self) -> dict:
        return {"waiters": len(self.waiters)}

    def _health_stub(self, channel):
        return PrefillWorkerStub(channel)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            fut = self.waiters.get(out.request_id)
            if fut is not None and out.finished and not fut.done():
                fut.set_result(out)

    def _in_flight(self) -> list[str]:
        return sorted(self.waiters)

    def _fail_in_flight(self, reason: str) -> None:
        for fut in self.waiters.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    def _sender(self, backend: str):
        if backend not in self.senders:
            cfg = KVTransferConfig(backend=backend, security=self.config.security,
                                   mooncake_protocol=self.config.kv_protocol,
                                   mooncake_device=self.config.rdma_device or "")
            self.senders[backend] = create_sender(backend, cfg, metrics=self.metrics)
        return self.senders[backend]

    # ---- gRPC -------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:  # noqa: N802
        rid = request.request_id
        if self.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.worker_id}: {self.failed}")
        if not rid or rid in self.waiters:  # never touch another caller's request
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid!r} is empty or in use")
        if not 0 <= request.timeout_s <= MAX_PUSH_TIMEOUT_S:  # also rejects NaN
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request {rid}: timeout_s {request.timeout_s} is not in [0, {MAX_PUSH_TIMEOUT_S}]")
        if request.kv_backend not in BACKENDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request {rid}: kv_backend {request.kv_backend!r} is not one of {BACKENDS}")
        try:
            sampling = sampling_from_proto(request.sampling)  # the first token: min_tokens 1 at most
            params = replace(sampling, max_tokens=1, stop=[], n=1, min_tokens=min(sampling.min_tokens, 1))
        except InvalidSamplingParams as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
        tokens = len(request.prompt_token_ids)
        self._observe_rate()
        why = self.throughput.refusal(tokens, request.timeout_s, time.monotonic())
        if why is not None:  # admission.py: it would miss the deadline and be computed twice
            self.metrics.prefill_refused.labels(worker=self.worker_id).inc()
            log.info("prefill worker %s refuses request %s: %s", self.worker_id, rid, why)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"request {rid}: prefill worker {self.worker_id}: {why}; prefill it locally")
        fut: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.waiters[rid] = fut
        self.throughput.started(tokens)
        span = tracing.start("prefill_worker.prefill", tracing.extract_grpc(context), "server",
                             {**tracing.request_attributes(self.config.engine.model_id, sampling, tokens),
                              "gen_ai.response.id": rid, "splitserve.worker": self.worker_id})
        if tracing.enabled():
            self.trace_spans[rid] = span
        try:
            try:
                self.handed_to_engine(tokens)
                await self.engine.add_request(rid, list(request.prompt_token_ids), params, hold_kv=True)
            except (InvalidPromptError, ValueError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
            first = await fut
            if first.error is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"request {rid}: prefill worker {self.worker_id}: {first.error}")
            if first.finish_reason == "abort":
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid}: aborted on {self.worker_id}")
            src, hashes = await self.engine.held_blocks(rid, request.skip_blocks)
            if len(src) != len(request.dest_block_ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request {rid}: {len(request.dest_block_ids)} destination blocks for "
                                    f"{len(src)} prompt blocks after skipping {request.skip_blocks}")
            result = None
            if src:
                # current: the push thread (to_thread copies the context) sends it in the transfer's metadata
                with tracing.current_span("kv_transfer", span, "client", {
                        "splitserve.kv.backend": request.kv_backend, "splitserve.kv.blocks": len(src),
                        "splitserve.kv.receiver": request.kv_receiver_address}) as kv_span:
                    result = await asyncio.to_thread(
                        self._sender(request.kv_backend).push, rid, request.kv_receiver_address,
                        self.engine.kv_pool, src, list(request.dest_block_ids), hashes,
                        timeout=request.timeout_s or None)
                    kv_span.set_attributes({"splitserve.kv.bytes": result.nbytes, "splitserve.kv.attempts":
                                            result.attempts, "splitserve.kv.retries": result.attempts - 1})
        except KVTransferError as exc:
            log.warning("prefill worker %s: %s", self.worker_id, exc)
            tracing.fail(span, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: prefill worker {self.worker_id}: {exc}")
        except BaseException as exc:
            tracing.fail(span, exc)
            raise
        finally:
            self.waiters.pop(rid, None)
            self.trace_spans.pop(rid, None)
            span.end()
            # Shielded: a second cancellation of this handler must not leave the blocks held.
            # `fut` holds a result only if the prefill finished: a handler cancelled at
            # `await fut` (the decode side's deadline) cancels `fut` as well, so "done" alone
            # does not say it finished. Deciding on "done" skipped the abort, the prompt's
            # remaining chunks ran on and it finished into the held set with nobody left to
            # release it (issue 38).
            finished = fut.done() and not fut.cancelled()
            self.throughput.finished(tokens)
            self._observe_rate()
            await asyncio.shield(asyncio.ensure_future(self._release(rid, abort=not finished)))
        # the step's part only (the first output's new token is its only one): an engine in its
        # own process sends no cumulative fields (engine/engine_process.py)
        reply = pb.PrefillReply(first_token_id=first.new_token_ids[0], num_cached_tokens=first.num_cached_tokens,
                                worker_id=self.worker_id)
        if first.new_logprobs:
            reply.first_logprob.CopyFrom(logprob_to_proto(first.new_logprobs[0]))
            reply.has_logprob = True
        if result is not None:
            reply.kv_bytes, reply.kv_seconds = result.nbytes, result.seconds
        return reply

    def _observe_rate(self) -> None:
        s = self.engine.stats
        self.throughput.observe(s.prompt_tokens_computed, s.step_seconds, time.monotonic())
        if self.throughput.tokens_per_s:
            self.metrics.prefill_tokens_per_second.labels(worker=self.worker_id).set(self.throughput.tokens_per_s)

    async def _release(self, rid: str, abort: bool) -> None:
        try:
            if abort:  # the caller went away before the prefill finished
                await self.engine.abort(rid)
            await self.engine.release_held(rid)
        except EngineDeadError:
            pass  # nothing left to free: the process is about to be replaced

    async def _sweep_held(self) -> None:
        """Release held blocks that a Prefill call no longer owns: the hold's lease is the
        call, and a hold that outlives it by ORPHAN_GRACE_S is a leak (issue 38) that must
        not shrink the pool for good."""
        while True:
            await asyncio.sleep(HELD_SWEEP_S)
            try:
                held = await self.engine.held_summary()
            except EngineDeadError:
                continue  # the worker is going away; the watchdog says so
            except Exception as exc:  # noqa: BLE001 - the sweep must outlive one bad answer
                log.warning("prefill worker %s: could not read its held KV blocks (%r); trying again in %.0f s",
                            self.worker_id, exc, HELD_SWEEP_S)
                continue
            self._observe_rate()  # a long burst is measured while it runs, not only at admissions
            now = time.monotonic()
            self.orphans = {rid: t for rid, t in self.orphans.items() if rid in held and rid not in self.waiters}
            for rid, blocks in held.items():
                if rid in self.waiters:
                    continue
                since = self.orphans.setdefault(rid, now)
                if now - since >= ORPHAN_GRACE_S:
                    log.error("prefill worker %s: request %s has held %d KV blocks for a push for %.0f s with no "
                              "Prefill call left to push them; releasing them. This is a bug: please report it "
                              "with this log", self.worker_id, rid, blocks, now - since)
                    self.metrics.kv_held_expired.labels(worker=self.worker_id).inc()
                    self.held_expired += 1
                    self.orphans.pop(rid)
                    await self._release(rid, abort=False)

    async def Health(self, request, context) -> pb.HealthReply:  # noqa: N802
        r = self.load_report()
        return pb.HealthReply(worker_id=self.worker_id, role="prefill", running=r.running, waiting=r.waiting,
                              kv_usage=r.kv_usage)
