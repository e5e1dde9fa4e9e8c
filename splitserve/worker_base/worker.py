"""WorkerBase: the engine thread, presence on the bus, health and failure handling of a
worker. `DecodeWorker` and `PrefillWorker` add their gRPC service on top.

Health tells the truth: a worker is healthy only while it is started, not draining,
its engine thread alive and not stalled, and its gRPC server answering. When the engine
thread dies the worker does not linger as a zombie: it leaves the registry at once (so
routers stop sending to it), fails its in-flight requests with a retryable status (so
the router migrates them), and sets `fatal`, on which its host process exits to be
restarted (Ray restarts the actor; Kubernetes the container).

(Just over 300 lines: the engine thread's life, health and the load report that carries
every feature's state (adapters, speculation, offload tiers) to the routers are one
lifecycle; the per-feature metric syncing already lives in metrics.py.)
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time

import grpc

from splitserve.cluster.messages import LoadReport, WorkerInfo
from splitserve.cluster.presence import WorkerPresence
from splitserve.cluster.registration_auth import signed
from splitserve.cluster.remote_bus import open_bus
from splitserve.core import tracing
from splitserve.core.model_config import kv_bytes_per_token
from splitserve.core.model_dir import served_config
from splitserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineStalledError
from splitserve.engine.engine_process import EngineProcess, use_engine_process
from splitserve.engine.handle import EngineHandle
from splitserve.engine.heap import freeze_startup_heap
from splitserve.engine.llm_engine import LLMEngine, RequestOutput
from splitserve.engine.stats import EngineStats
from splitserve.metrics import Metrics, sync_expert_tokens, sync_kv_offload, sync_lora
from splitserve.proto.convert import pb
from splitserve.worker_base.config import WorkerConfig, advertised_host

log = logging.getLogger(__name__)

# A restarted peer is dialled again within 2 s (gRPC's default backoff grows to 2 min).
RECONNECT_OPTIONS = [("grpc.max_reconnect_backoff_ms", 2000), ("grpc.initial_reconnect_backoff_ms", 200)]


class WorkerBase(abc.ABC):
    role = ""

    def __init__(self, config: WorkerConfig, metrics: Metrics | None = None, bus=None):
        self.config = config
        self.worker_id = config.worker_id
        self.metrics = metrics or Metrics()
        self._given_bus = bus  # tests and `splitserve serve` may share one bus object
        self.address = ""
        self.admin_url = ""
        self.draining = False
        self.failed: str | None = None  # why this worker can no longer serve (its engine died)
        self.fatal = asyncio.Event()  # set once failed: the host process should exit and be restarted
        self.engine: EngineHandle | None = None  # on a thread (AsyncEngine) or in a process (EngineProcess)
        self.presence: WorkerPresence | None = None
        self._admin = None
        self._self_channel: grpc.aio.Channel | None = None
        self._watchdog: asyncio.Task | None = None
        self.server: grpc.aio.Server | None = None  # this role's gRPC service
        self.metrics.engine_alive.labels(role=self.role, worker=self.worker_id).set(0)
        tracing.configure(config.tracing, f"splitserve-{self.role}")
        self.trace_spans: dict[str, object] = {}  # request id -> its server span (tracing on only)
        self._handed: list[tuple[float, int]] = []  # (time, prompt tokens) of prompts given the engine to compute

    # ---- start / stop ---------------------------------------------------------------------
    async def _start_admin(self, app) -> None:
        """Up first: /health says "starting" while the model loads."""
        from splitserve.worker_base.admin import start_admin

        cfg = self.config
        self._admin, port = await start_admin(app, cfg.host, cfg.admin_port)
        self.admin_url = f"http://{advertised_host(cfg.host, cfg.advertise_host)}:{port}"

    async def _start_engine(self) -> LLMEngine | EngineProcess:
        """The engine on a thread of this process, or in a child process (engine_process.py);
        either way what is returned has `kv_pool`, `model_id` and `num_total_blocks`."""
        callbacks = dict(on_dead=self._engine_died, on_step_failure=self._engine_step_failed,
                         on_step_timing=self._count_step, name=self.worker_id,
                         stall_timeout_s=self.config.engine_stall_timeout_s,
                         heartbeat_timeout_s=self.config.engine_heartbeat_timeout_s)
        loop = asyncio.get_running_loop()
        # a worker streams each step's part: no copy of the prompt and the output so far per token
        config = dataclasses.replace(self.config.engine, delta_outputs=True)
        if use_engine_process(config, self.config.engine_process):
            proc = EngineProcess(config, loop, self._on_outputs, self._on_block_events, **callbacks)
            self.engine = engine = await asyncio.to_thread(proc.launch)
        else:
            engine = await asyncio.to_thread(LLMEngine, config)
            # under TP the ranks' pools, shared before the engine thread steps (a broadcast to them)
            await asyncio.to_thread(engine.executor.transfer_pool)
            self.engine = AsyncEngine(engine, loop, self._on_outputs, self._on_block_events, **callbacks)
        freeze_startup_heap()  # engine/heap.py: full collections stop walking the start-up heap
        self.engine.start()
        if isinstance(self.engine, EngineProcess):
            self.metrics.engine_process_cpu_seconds.labels(role=self.role, worker=self.worker_id).set_function(
                self.engine.cpu_seconds)
        self.metrics.engine_alive.labels(role=self.role, worker=self.worker_id).set(1)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine())
        return engine

    def _server(self, **options) -> grpc.aio.Server:
        return self.config.security.aio_server(**options)

    async def _bind(self, server: grpc.aio.Server) -> str:
        cfg = self.config
        port = cfg.security.add_port(server, f"{cfg.host}:{cfg.port}")
        if port == 0:
            raise OSError(f"{self.role} worker {self.worker_id} could not listen on {cfg.host}:{cfg.port}")
        await server.start()
        self.address = f"{advertised_host(cfg.host, cfg.advertise_host)}:{port}"
        return self.address

    async def _start_presence(self, engine: LLMEngine) -> None:
        cfg = self.config
        self.bus = self._given_bus or open_bus(cfg.bus_url, cfg.cluster, cfg.security)
        info = signed(WorkerInfo(self.worker_id, self.role, self.address, engine.model_id, cfg.engine.block_size,
                                 engine.num_total_blocks, cfg.kv_backend, kv_cache_dtype=self.kv_dtype_name()),
                      cfg.security.token)  # routers with the token refuse unsigned registrations
        self.presence = WorkerPresence(self.bus, info, self.load_report, ttl=cfg.heartbeat_ttl_s,
                                       cached_blocks=self._cached_blocks, healthy=self._unhealthy_because)
        await self.presence.start()
        self.num_kv_blocks = engine.num_total_blocks
        self.metrics.kv_capacity_tokens.labels(role=self.role, worker=self.worker_id).set(
            engine.num_total_blocks * cfg.engine.block_size)

    def kv_dtype_name(self) -> str:
        """The KV pool's element type as registration carries it ("float8_e4m3fn" for --kv-cache-dtype fp8)."""
        return str(self.config.engine.kv_torch_dtype).removeprefix("torch.")

    def kv_pool_description(self) -> str:
        """What the start-up lines say of the KV pool: its size in blocks and tokens, its dtype, and
        what a token costs (MLA's latent row is several times smaller than a GQA model's K and V)."""
        blocks, engine = self.num_kv_blocks, self.config.engine
        text = f"{blocks} KV blocks = {blocks * engine.block_size} tokens of {self.kv_dtype_name()}"
        model = served_config(engine.model)
        if model is None:
            return text
        per_token = kv_bytes_per_token(model, engine.tensor_parallel_size, engine.kv_torch_dtype.itemsize)
        what = f"one latent row of {model.head_dim}" if model.kv_lora_rank else f"K and V of {model.head_dim} a head"
        rank = " a rank" if engine.tensor_parallel_size > 1 else ""
        return f"{text} ({per_token} bytes a token{rank}: {what}, {model.num_layers} layers)"

    async def _stop_common(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.presence is not None:
            await self.presence.stop()
        if self._self_channel is not None:
            await self._self_channel.close()
        if self.engine is not None:
            self.engine.stop()
        if self._given_bus is None and getattr(self, "bus", None) is not None:
            await self.bus.close()
        if self._admin is not None:
            await self._admin.cleanup()

    # ---- state --------------------------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def handed_to_engine(self, prompt_tokens: int) -> None:
        """A prompt this worker's engine is to compute was just handed to it."""
        self._handed.append((time.time(), prompt_tokens))

    def _tokens_not_in(self, s: EngineStats) -> int:
        """Prompt tokens handed to the engine since its stats were taken: a step can take
        seconds, and until the next snapshot they were in no load report (and the router,
        which counts what it sent only until a report comes, placed prompts by the rest)."""
        self._handed = [(t, n) for t, n in self._handed if t >= s.taken_at]
        return sum(n for _, n in self._handed)

    def load_report(self) -> LoadReport:
        s = self.stats
        waiting, waiting_tokens = self._load_numbers(s)
        waiting_tokens += self._tokens_not_in(s)
        m, labels = self.metrics, {"role": self.role, "worker": self.worker_id}
        m.sync_engine_counters(self.role, self.worker_id, s.prefix_query_tokens, s.prefix_hit_tokens, s.preemptions,
                               s.overlapped_steps)
        sync_lora(m, self.role, self.worker_id, s.loras)  # adapters resident, swaps in (engine/lora/)
        if s.spec_decode is not None:  # speculative decoding (engine/spec/)
            m.sync_spec_decode(self.role, self.worker_id, s.spec_decode)
        if s.kv_offload is not None:  # host / disk tiers (engine/kv_offload/)
            sync_kv_offload(m, self.role, self.worker_id, s.kv_offload)
        if s.expert_tokens:  # tokens per expert of a MoE model (engine/expert_tokens.py)
            sync_expert_tokens(m, self.role, self.worker_id, s.expert_tokens)
        m.num_requests_waiting.labels(**labels).set(waiting)
        m.num_requests_running.labels(**labels).set(s.running)
        m.kv_cache_usage.labels(**labels).set(s.kv_usage)
        if s.total_state_slots:  # a hybrid model's recurrent-state slots (engine/recurrent_state.py)
            m.state_slot_usage.labels(**labels).set(s.state_slot_usage)
        return LoadReport(self.worker_id, self.role, waiting, s.running, s.kv_usage, waiting_tokens=waiting_tokens,
                          loras={a[0]: a[1] for a in s.loras}, resident_loras=[a[0] for a in s.loras if a[2]])

    def _load_numbers(self, s: EngineStats) -> tuple[int, int]:
        """(waiting requests, queued prompt tokens) as this role reports them."""
        return s.waiting, s.queued_prompt_tokens

    def kv_state(self) -> dict:
        """Block accounting for /health: once every request has ended, free == total."""
        s = self.stats
        return {"free_blocks": s.free_blocks, "total_blocks": s.total_blocks, "sequences": s.sequences,
                **self._kv_extras(s)}

    def _kv_extras(self, s: EngineStats) -> dict:
        return {}

    def admin_extras(self) -> dict:
        """Role-specific fields of /health."""
        return {}

    async def _unhealthy_because(self) -> str:
        """What the heartbeat checks: "" while the worker can serve (draining included: its
        registration says so), else why not. The same checks as /health."""
        ok, status, detail = await self.health()
        return "" if ok or status == "draining" else f"{status}: {detail}"

    async def health(self) -> tuple[bool, str, str]:
        """(healthy, status word, detail) for /health and the liveness probe."""
        if self.failed:
            return False, "failed", self.failed
        if self.engine is None or not self.address:
            return False, "starting", "the model is loading"
        ok, why = self.engine.health()
        if not ok:
            return False, "engine_unhealthy", why
        if self.draining:
            return False, "draining", "draining: no new requests"
        try:
            await self._probe_grpc()
        except grpc.aio.AioRpcError as exc:
            return False, "grpc_unhealthy", f"own gRPC server at {self.address}: {exc.code().name} {exc.details()}"
        return True, "ok", ""

    async def _probe_grpc(self) -> None:
        """A Health call to our own gRPC server, through the same door peers use."""
        if self._self_channel is None:
            self._self_channel = self.config.security.aio_channel(self.address)
        stub = self._health_stub(self._self_channel)
        await stub.Health(pb.HealthRequest(), timeout=2.0, metadata=self.config.security.metadata)

    @abc.abstractmethod
    def _health_stub(self, channel):
        """This role's gRPC stub on `channel` (each has a Health method)."""

    async def _cached_blocks(self) -> list[int]:
        return await self.engine.cached_block_hashes()

    def _on_block_events(self, events) -> None:
        if self.presence is not None:
            self.presence.publish_block_events(events)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: a step's outputs; first tokens say where their time went."""
        for out in outputs:
            if out.queue_s is not None:
                labels = {"role": self.role, "worker": self.worker_id}
                self.metrics.request_queue_time.labels(**labels).observe(out.queue_s)
                self.metrics.request_prefill_time.labels(**labels).observe(out.prefill_s)
                if out.request_id in self.trace_spans:
                    self._trace_first_token(out)
        self._dispatch(outputs)

    def _trace_first_token(self, out: RequestOutput) -> None:
        """Queue and prefill spans from the engine's own timings (the engine, maybe in its own
        process, exports nothing): its first token arrived now, after prefill_s of prefill that
        followed queue_s of waiting. Off by the pipe's latency, well under a step."""
        parent, end = self.trace_spans[out.request_id], time.time_ns()
        prefill_start = end - int(out.prefill_s * 1e9)
        attrs = {"splitserve.worker": self.worker_id, "splitserve.cached_tokens": out.num_cached_tokens}
        tracing.record("queue", parent, prefill_start - int(out.queue_s * 1e9), prefill_start, attrs)
        tracing.record("prefill", parent, prefill_start, end, attrs)

    @abc.abstractmethod
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: one engine step's outputs to the requests waiting for them."""

    def _count_step(self, wall_s: float, cpu_s: float) -> None:
        """On the engine thread (prometheus counters are thread-safe)."""
        labels = {"role": self.role, "worker": self.worker_id}
        self.metrics.engine_step_seconds.labels(**labels).inc(wall_s)
        self.metrics.engine_step_cpu_seconds.labels(**labels).inc(cpu_s)

    # ---- engine failures ------------------------------------------------------------------
    def _engine_step_failed(self, request_ids: list[str], exc: BaseException) -> None:
        self.metrics.engine_step_failures.labels(role=self.role, worker=self.worker_id).inc()

    async def _watch_engine(self) -> None:
        """A step past `engine_stall_timeout_s` makes the worker unhealthy: it leaves the
        registry (presence) and its streams migrate. Still stuck after twice that, the engine
        is given up for dead, so the process is replaced: a hung kernel never returns."""
        limit = 2 * self.config.engine_stall_timeout_s
        silent_limit = self.config.engine_heartbeat_timeout_s
        while self.failed is None and self.engine.alive:
            await asyncio.sleep(min(1.0, limit / 20, silent_limit / 4 or 1.0))
            if self.presence is not None:  # unhealthy (frozen, stalled): out of the registry now,
                ok, why = self.engine.health()  # not at the next heartbeat
                if not ok:
                    await self.presence.withdraw(f"engine_unhealthy: {why}")
            running = self.engine.step_running_s()
            if running is not None and running > limit:
                self._engine_died(EngineStalledError(f"one engine step has run for {running:.1f}s "
                                                     f"(> 2 x --engine-stall-timeout {limit / 2:g}s)"))

    def _engine_died(self, exc: BaseException) -> None:
        """On the event loop, once: the engine thread is gone for good."""
        if self.failed is not None:
            return
        where = "process" if isinstance(self.engine, EngineProcess) else "thread"
        self.failed = f"engine stalled: {exc}" if isinstance(exc, EngineStalledError) else f"engine {where} died: {exc!r}"
        self.metrics.engine_alive.labels(role=self.role, worker=self.worker_id).set(0)
        log.critical("%s worker %s: %s; leaving the registry, failing its in-flight requests (%s) so they are "
                     "retried elsewhere, and exiting to be restarted", self.role, self.worker_id, self.failed,
                     ", ".join(self._in_flight()) or "none")
        asyncio.get_running_loop().create_task(self._fail_over())

    async def _fail_over(self) -> None:
        try:
            if self.presence is not None:
                await self.presence.hide()
            self._fail_in_flight(f"{self.role} worker {self.worker_id}: {self.failed}")
            await asyncio.sleep(0.5)  # let the failed streams' statuses reach their callers
        finally:
            self.fatal.set()

    @abc.abstractmethod
    def _in_flight(self) -> list[str]:
        """Ids of the requests this worker is serving now (for the log line of a failure)."""

    @abc.abstractmethod
    def _fail_in_flight(self, reason: str) -> None:
        """End every in-flight request with a retryable error naming `reason`."""


__all__ = ["RECONNECT_OPTIONS", "EngineDeadError", "WorkerBase"]
