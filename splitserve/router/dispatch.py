"""The router's core: choose workers for a prompt, call the decode worker, and keep the
stream going when that worker dies (migration: prompt + tokens so far, elsewhere).
The policy itself is pure (policy.py, prefill_placement.py); what this router sent each
worker since its last load report is kept in worker_backlog.py.

(Just over 300 lines: choosing, calling and migrating are one request's retry loop, which
reads in order here; the decisions it makes are already pure functions elsewhere.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from splitserve.cluster.bus import ClusterBus
from splitserve.core import tracing
from splitserve.core.hashing import DEFAULT_BLOCK_SIZE, block_hashes, hash_seed
from splitserve.core.logprobs import TokenLogprobs
from splitserve.core.sampling_params import SamplingParams
from splitserve.metrics import Metrics
from splitserve.proto.convert import logprob_from_proto, pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub
from splitserve.router import errors
from splitserve.router.index_sync import IndexSync
from splitserve.router.lora import RouterLoRA, lora_candidates
from splitserve.router.policy import NoHealthyWorker, PolicyConfig, RouteDecision, route
from splitserve.router.radix_index import RadixIndex
from splitserve.router.worker_backlog import WorkerBacklog
from splitserve.security.links import NO_SECURITY, LinkSecurity

log = logging.getLogger(__name__)

ROUTING_MODES = ("prefix", "round-robin", "random")

# Every gRPC code except INVALID_ARGUMENT ("this request is bad") and, for a request under
# an adapter, NOT_FOUND ("that adapter is not loaded here": unloaded) means "this worker
# failed" (crashed, restarting, draining, refusing our certificate...): migrate.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                    # a restarted worker is dialled again within 2 s (gRPC's default backoff grows to 2 min)
                    ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.initial_reconnect_backoff_ms", 200)]


@dataclass
class DispatchConfig:
    model_id: str  # seeds the block-hash space; workers use the same
    block_size: int = DEFAULT_BLOCK_SIZE
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    max_migrations: int = 2
    seed: int | None = None  # routing RNG (tie breaks); fixed in tests
    mode: str = "prefix"  # prefix | round-robin | random (baselines for benchmarks)
    index_max_blocks: int = 1_000_000
    security: LinkSecurity = NO_SECURITY  # cluster token / mutual TLS to the decode workers
    stream_interval: int = 1  # tokens per worker chunk after the first (--stream-interval)


@dataclass
class StreamEvent:
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None
    num_cached_tokens: int = 0
    decode_worker: str = ""
    prefill_worker: str = ""
    prefill_cached_tokens: int = 0


class Dispatcher:
    def __init__(self, config: DispatchConfig, bus: ClusterBus, metrics: Metrics | None = None):
        self.config = config
        self.bus = bus
        self.metrics = metrics or Metrics()
        self.seed = hash_seed(config.model_id)
        self.index = RadixIndex(max_blocks=config.index_max_blocks)
        self.sync = IndexSync(bus, self.index, metrics=self.metrics, model=config.model_id,
                              block_size=config.block_size, on_departure=self._worker_left,
                              token=config.security.token)
        self.rng = random.Random(config.seed)
        self.loras = RouterLoRA(self.sync, config.security, config.model_id)  # adapters, their hash salts
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._calls: dict[str, set] = {}  # decode worker -> its Generate calls in flight
        self._evicted: set = set()  # calls cancelled because their worker left: migrate them
        self.backlog = WorkerBacklog(self.sync)
        self._task: asyncio.Task | None = None
        self._rr = 0
        if config.mode not in ROUTING_MODES:
            raise ValueError(f"routing mode {config.mode!r} is not one of {ROUTING_MODES}")

    async def start(self) -> None:
        await self.sync.catch_up()
        self._task = asyncio.create_task(self.sync.run(), name="index-sync")

    async def stop(self) -> None:
        self.sync.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for ch in self._channels.values():
            await ch.close()
        await self.loras.close()

    def prompt_hashes(self, prompt: list[int], lora: str | None = None) -> list[int]:
        """The workers' hashes of the prompt's blocks: under a LoRA adapter, salted by it."""
        return block_hashes(prompt, self.config.block_size, self.seed ^ self.loras.salt(lora))

    def _idle(self, worker: str) -> bool:
        """No stream runs on decode worker `worker`, as far as this router can tell."""
        return not self._calls.get(worker) and self.backlog.idle(worker)

    async def decide_waiting(self, prompt: list[int], wait_s: float, on_wait=None,
                             lora: str | None = None) -> RouteDecision:
        """decide(), but with no healthy decode worker first wait up to `wait_s` for one to
        register (a lone worker's late heartbeat, a restart); then NoHealthyWorker as
        decide() raises it. `on_wait()` runs once if it has to wait."""
        deadline = time.monotonic() + wait_s
        while not self.sync.live("decode") and time.monotonic() < deadline:
            if on_wait is not None:
                on_wait()
                on_wait = None
            await asyncio.sleep(0.1)
        return self.decide(prompt, lora=lora)[0]

    def decide(self, prompt: list[int], exclude: set[str] = frozenset(),
               lora: str | None = None) -> tuple[RouteDecision, list[int]]:
        start = time.perf_counter()
        hashes = self.prompt_hashes(prompt, lora)
        decode = [w for w in self.sync.live("decode") if w not in exclude]
        if lora is not None:  # workers that have the adapter; resident first
            decode = lora_candidates(decode, self.loras.have(decode, lora), self.sync.loads, lora)
        if not decode:
            raise NoHealthyWorker("no healthy decode worker" + (f" (excluding failed {sorted(exclude)})"
                                                                 if exclude else ""))
        prefill = self.sync.live("prefill")
        if lora is not None:  # a prefill worker without the adapter would compute the base model's KV
            prefill = self.loras.have(prefill, lora)
        workers = decode + prefill
        peers = decode if lora is None else []  # a prefix pull moves base-model blocks only
        if self.config.mode != "prefix":  # baseline: ignore overlap and load for the decode choice
            decode = sorted(decode)
            if self.config.mode == "round-robin":
                self._rr += 1
                decode = [decode[self._rr % len(decode)]]
            else:
                decode = [self.rng.choice(decode)]
        pending = {w: self.backlog.pending(w) for w in workers}
        decision = route(len(prompt), self.config.block_size, self.index.match(hashes), decode, prefill,
                         self.sync.loads, self.rng, self.config.policy,
                         pending={w: len(sent) for w, sent in pending.items()}, peers=peers,
                         pending_tokens={w: sum(n for _, n in sent) for w, sent in pending.items()},
                         is_idle=self._idle)
        self.backlog.record(decision, len(prompt), self.config.block_size)
        for w in filter(None, (decision.decode_worker, decision.prefill_worker)):
            self.sync.record_routed(w, hashes)
        self.metrics.router_decision_seconds.observe(time.perf_counter() - start)
        self.metrics.router_requests.labels(worker=decision.decode_worker, path=decision.path).inc()
        if tracing.enabled():  # a child of the request's span (current in its handler)
            tracing.record("route", None, time.time_ns() - int((time.perf_counter() - start) * 1e9), time.time_ns(),
                           route_attributes(decision))
        return decision, hashes

    def _stub(self, worker: str) -> DecodeWorkerStub | None:
        """None when the worker has left the registry since it was chosen."""
        state = self.sync.workers.get(worker)
        if state is None:
            return None
        address = state.info.address
        if address not in self._channels:
            self._channels[address] = self.config.security.aio_channel(address, _CHANNEL_OPTIONS)
        return DecodeWorkerStub(self._channels[address])

    def _worker_left(self, worker: str) -> None:
        """A decode worker left the registry (dead, wedged, draining): its streams cannot be
        trusted to finish, so they migrate now rather than hang."""
        calls = self._calls.pop(worker, set())
        if calls:
            log.warning("decode worker %s left the registry with %d streams in flight: migrating them", worker,
                        len(calls))
        for call in calls:
            self._evicted.add(call)
            call.cancel()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       decision: RouteDecision) -> AsyncIterator[StreamEvent]:
        """Stream one choice. Worker failures migrate the request (bounded); a request the
        worker rejects raises APIError (400; 404 for an adapter it no longer has)."""
        produced: list[int] = []
        failed: set[str] = set()
        attempt = 0
        parent = tracing.current()  # the request's span: this generator is not a place to make spans current
        while True:
            call, finished = None, False
            if params.resumed(len(produced)) is None:
                # the worker died between its last token and the finish: nothing is left to generate
                yield StreamEvent([], [], "length")
                return
            span = tracing.start("router.generate", parent, "client", {
                **tracing.request_attributes(self.config.model_id, params, len(prompt)),
                "gen_ai.response.id": request_id, "splitserve.attempt": attempt,
                "splitserve.route.decode_worker": decision.decode_worker,
                "splitserve.route.prefill_worker": decision.prefill_worker or ""})
            first_token = tracing.start("first_token", span) if not produced else None
            try:
                req = pb.GenerateRequest(request_id=f"{request_id}/{attempt}" if attempt else request_id,
                                         prompt_token_ids=prompt, sampling=sampling_to_proto(params),
                                         resume_token_ids=produced, stream_interval=self.config.stream_interval)
                if decision.prefill_worker:
                    info = self.sync.workers.get(decision.prefill_worker)
                    if info is not None:
                        req.prefill_address, req.prefill_worker_id = info.info.address, decision.prefill_worker
                peer = self.sync.workers.get(decision.pull_worker) if decision.pull_worker and not produced else None
                if peer is not None:  # the peer holds more of the prefix: the worker pulls it (decode_worker/peer_pull.py)
                    req.pull_worker_id, req.pull_address = decision.pull_worker, peer.info.address
                    req.pull_blocks = decision.pull_blocks
                stub = self._stub(decision.decode_worker)
                if stub is None:
                    raise _Gone(decision.decode_worker)
                call = stub.Generate(req, metadata=tracing.inject(self.config.security.metadata, span))
                self._calls.setdefault(decision.decode_worker, set()).add(call)
                settled = False
                async for chunk in call:
                    if not settled:  # the first chunk: the prompt is computed
                        self.backlog.settle(decision)
                        settled = True
                    produced.extend(chunk.token_ids)
                    if first_token is not None:
                        first_token.end()
                        first_token = None
                    # A finished call is not cancelled below: the worker is sending its closing
                    # status now, and a reset racing that has grpc log an error on the worker for a
                    # stream that ended well (and costs a cancel per request here).
                    finished = bool(chunk.finish_reason)
                    if finished:
                        span.set_attributes({"gen_ai.usage.output_tokens": len(produced),
                                             "gen_ai.response.finish_reasons": [chunk.finish_reason]})
                    yield StreamEvent(list(chunk.token_ids), [logprob_from_proto(lp) for lp in chunk.logprobs],
                                      chunk.finish_reason or None, chunk.num_cached_tokens, chunk.worker_id,
                                      chunk.prefill_worker_id, chunk.prefill_cached_tokens)
                    if finished:
                        return
                reason = "stream ended without a finish reason"
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise errors.invalid_request(exc.details() or "rejected by the decode worker") from None
                if exc.code() == grpc.StatusCode.NOT_FOUND and params.lora_name:  # unloaded while routed
                    raise errors.model_not_found(params.lora_name, self.loras.models()) from None
                reason = f"{exc.code().name}: {exc.details()}"
            except _Gone:
                reason = "it left the registry (stopped heartbeating)"
            except asyncio.CancelledError:
                if call not in self._evicted or asyncio.current_task().cancelling():
                    raise  # our own caller was cancelled (client gone, deadline)
                reason = "it left the registry mid-stream (dead, wedged or draining)"
            finally:
                self.backlog.settle(decision)
                if call is not None:
                    if not finished:
                        call.cancel()
                    self._evicted.discard(call)
                    self._calls.get(decision.decode_worker, set()).discard(call)
                    self.backlog.call_ended(decision.decode_worker)
                for s in (first_token, span):
                    if s is not None:
                        if not finished:
                            tracing.fail(s, RuntimeError("the stream ended early"))
                        s.end()
            failed.add(decision.decode_worker)
            if attempt >= self.config.max_migrations:
                raise WorkerFailure(f"request {request_id}: decode worker(s) {sorted(failed)} failed "
                                    f"({reason}); gave up after {attempt} migration(s)")
            attempt += 1
            log.warning("request %s: decode worker %s failed after %d tokens (%s); migrating", request_id,
                        decision.decode_worker, len(produced), reason)
            self.metrics.request_migrations.labels(reason="worker_failure").inc()
            try:
                with tracing.span("migration", parent, attributes={
                        "splitserve.migration.from": decision.decode_worker, "splitserve.migration.reason": reason,
                        "splitserve.migration.tokens_so_far": len(produced)}) as moved:
                    decision, _ = self.decide(prompt + produced, exclude=failed, lora=params.lora_name)
                    moved.set_attribute("splitserve.migration.to", decision.decode_worker)
            except NoHealthyWorker as exc:
                raise WorkerFailure(f"request {request_id}: decode worker {sorted(failed)} failed ({reason}) "
                                    f"and no other can take it over: {exc}") from None


def route_attributes(decision: RouteDecision) -> dict:
    return {"splitserve.route.decode_worker": decision.decode_worker,
            "splitserve.route.prefill_worker": decision.prefill_worker or "",
            "splitserve.route.path": decision.path, "splitserve.route.reason": decision.reason,
            "splitserve.route.prefill_reason": decision.prefill_reason,
            "splitserve.route.prompt_blocks": decision.prompt_blocks,
            "splitserve.route.prefix_hit_blocks": decision.decode_cached_blocks,
            "splitserve.route.prefill_prefix_hit_blocks": decision.prefill_cached_blocks}


class _Gone(Exception):
    """The chosen decode worker is no longer registered."""


class WorkerFailure(RuntimeError):
    """The request could not be completed on any decode worker (the server answers 503)."""
