"""An LLMEngine on its own thread, driven from asyncio.

The engine is single-threaded by design; workers are asyncio servers. Calls are
queued to the engine thread and answered through futures (a worker's calls are the
EngineHandle's, engine/handle.py, each run by name on the engine); every step's outputs
and KV events are handed back to the event loop, and after every loop iteration
the thread publishes an immutable `EngineStats`, the only engine state other
threads read.

Nothing a client does may kill this thread:
- a caller cancelled before its command ran: the command is skipped (the caller's
  cleanup, queued after it, finds nothing to undo); once a command runs its future
  can no longer be cancelled, so its result is always delivered (and discarded by a
  caller that went away, whose own cleanup then undoes it);
- a step that raises fails the requests of that step with an error (the worker turns
  it into a retryable gRPC status, so the router migrates them) and the loop goes on;
  `max_step_failures` failures in a row mean the engine is broken: it is declared dead.
Death (that, or anything escaping the loop) fails every queued command with
`EngineDeadError` and calls `on_dead` on the event loop: the worker leaves the
registry, fails its streams and exits so it is restarted. A step that never returns
is seen by `health()` as a stall.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from splitserve.core.block_events import BlockEvent
from splitserve.engine.faults import FaultPlan
from splitserve.engine.handle import EngineHandle
from splitserve.engine.llm_engine import LLMEngine, RequestOutput
from splitserve.engine.parallel.state import RankLost
from splitserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped for good; the worker must be restarted."""


class EngineStalledError(EngineDeadError):
    """One engine step has run so long that the engine is given up for dead."""


def engine_health(kind: str, alive: bool, error: BaseException | None, running_s: float | None,
                  stall_timeout_s: float) -> tuple[bool, str]:
    """(healthy, why not) of an engine loop (`kind`: thread or process): dead, or one step
    running longer than `stall_timeout_s`."""
    if not alive:
        return False, f"engine {kind} is dead: {error!r}" if error else f"engine {kind} is not running"
    if running_s is not None and running_s > stall_timeout_s:
        return False, f"engine step running for {running_s:.0f}s (> {stall_timeout_s:.0f}s): the engine is stalled"
    return True, ""


def rank_health(silence: tuple[float, str] | None, heartbeat_timeout_s: float) -> tuple[bool, str]:
    """(healthy, why not) of a tensor-parallel engine's other ranks (TensorParallelGroup.silence):
    one silent past the heartbeat timeout is frozen or starved. The engine waits for it (its
    collectives have no timeout); the worker leaves the registry until it answers again."""
    if silence is None or not heartbeat_timeout_s or silence[0] <= heartbeat_timeout_s:
        return True, ""
    age, who = silence
    return False, (f"{who} has not answered a heartbeat for {age:.0f}s (> --engine-heartbeat-timeout "
                   f"{heartbeat_timeout_s:g}s): frozen (SIGSTOP, a hung system call) or starved of CPU")


class AsyncEngine(EngineHandle):
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 on_events: Callable[[list[BlockEvent]], None] | None = None, *,
                 on_dead: Callable[[BaseException], None] | None = None, name: str = "engine",
                 max_step_failures: int = 3, stall_timeout_s: float = 120.0,
                 on_step_failure: Callable[[list[str], BaseException], None] | None = None,
                 on_step_timing: Callable[[float, float], None] | None = None,
                 deliver: Callable[..., None] | None = None, heartbeat_timeout_s: float = 0.0):
        self.engine = engine
        self.loop = loop
        # How a callback reaches its caller: on the event loop by default; an engine process
        # (engine/engine_process.py) passes its own, which sends it to the parent.
        self._deliver = deliver or loop.call_soon_threadsafe
        self.on_outputs = on_outputs
        self.on_events = on_events
        self.on_dead = on_dead
        self.on_step_failure = on_step_failure
        self.on_step_timing = on_step_timing  # (wall s, engine-thread CPU s) per step, on the engine thread
        self.name = name
        self.max_step_failures = max_step_failures
        self.stall_timeout_s = stall_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s  # for the tensor-parallel ranks; 0: not watched
        self.faults = FaultPlan.from_env(name)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._dead_lock = threading.Lock()  # `dead` and the queue: nothing is queued after the last drain
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self.steps = 0
        self.step_failures = 0  # all of them, for metrics
        self.error: BaseException | None = None  # why the thread died
        self.dead = False
        self.stats: EngineStats = engine.stats()
        self._step_started: float | None = None  # monotonic time of the step in progress

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():  # no step can run now: the offload writer (a stop leaves no
            self.engine.close()  # disk-tier files behind) and any tensor-parallel ranks end here

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.dead

    def step_running_s(self) -> float | None:
        """How long the step in progress has been running; None between steps."""
        started = self._step_started
        return None if started is None else time.monotonic() - started

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): dead, a step running longer than `stall_timeout_s`, or a
        tensor-parallel rank silent past `heartbeat_timeout_s`."""
        ok, why = engine_health("thread", self.alive, self.error, self.step_running_s(), self.stall_timeout_s)
        return rank_health(self.engine.executor.silence(), self.heartbeat_timeout_s) if ok else (ok, why)

    # ---- calls from the event loop -------------------------------------------------------
    async def call(self, fn: Callable, *args, **kwargs):
        """Run fn(*args) on the engine thread (between steps) and return its result.
        Raises EngineDeadError once the engine has died."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs), loop=self.loop)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Queue fn(*args) for the engine thread; its Future holds the result (from any thread)."""
        fut: Future = Future()
        with self._dead_lock:
            if self.dead:
                raise EngineDeadError(f"engine {self.name} is dead: {self.error!r}")
            self._commands.put((fn, args, kwargs, fut))
        return fut

    async def _invoke(self, method: str, *args, result: bool = True):
        """The worker's calls (engine/handle.py) run on the engine thread, between steps."""
        return await self.call(getattr(self.engine, method), *args)

    @property
    def kv_pool(self):
        """KV tensors, read off-thread only for blocks the engine holds for a push."""
        return self.engine.kv_pool

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        failures_in_a_row = 0
        try:
            while not self._stopped.is_set():
                self._run_commands(wait=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step_started = time.monotonic()
                    cpu_started = time.thread_time()
                    try:
                        self.faults.before_step(self.steps)
                        outputs = self.engine.step()
                        failures_in_a_row = 0
                    except Exception as exc:  # noqa: BLE001 - fail the step's requests, not the thread
                        failures_in_a_row += 1
                        outputs = self._fail_running(exc, failures_in_a_row)
                    finally:
                        if self.on_step_timing is not None:
                            self.on_step_timing(time.monotonic() - self._step_started,
                                                time.thread_time() - cpu_started)
                        self._step_started = None
                    self.steps += 1
                    if outputs:
                        self._deliver(self.on_outputs, outputs)
                self._flush_events()
                # what arrived during the step joins the queue now, so the snapshot counts every
                # request handed over before it (a step can take seconds: load reports counted
                # prompts sent meanwhile nowhere, and the router placed prompts by them)
                self._run_commands(wait=False)
                self.stats = self.engine.stats(self.steps)
        except BaseException as exc:  # noqa: BLE001 - anything escaping kills the engine: say so
            if not self._stopped.is_set():
                self.error = exc
                log.critical("engine %s died (%r); in flight: %s", self.name, exc,
                             sorted(self.engine.sequences) or "nothing", exc_info=exc)
        finally:
            self._die()

    def _run_commands(self, wait: bool) -> None:
        """Everything queued, before the next step; when idle, wait a little for work."""
        try:
            item = self._commands.get(timeout=0.1) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._run_command(item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _run_command(item) -> None:
        fn, args, kwargs, fut = item
        if not fut.set_running_or_notify_cancel():
            return  # the caller was cancelled before this ran: nothing applied, nothing to answer
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _fail_running(self, exc: Exception, in_a_row: int) -> list[RequestOutput]:
        """A step raised: its requests end with an error (retryable elsewhere)."""
        self.step_failures += 1
        rids = sorted(self.engine.sequences)
        log.error("engine %s: step failed (%d in a row; requests %s): %r", self.name, in_a_row, rids, exc,
                  exc_info=exc)
        if self.on_step_failure is not None:
            self._deliver(self.on_step_failure, rids, exc)
        outputs = self.engine.fail_all(f"engine step failed on {self.name}: {exc!r}")
        # a tensor-parallel rank that is gone fails every later step: dead now, not 3 requests later
        if in_a_row >= self.max_step_failures or isinstance(exc, RankLost):
            if outputs:  # their callers hear of it before the engine is declared dead
                self._deliver(self.on_outputs, outputs)
            raise EngineDeadError(f"{in_a_row} engine steps failed in a row, last: {exc!r}") from exc
        return outputs

    def _flush_events(self) -> None:
        if self.on_events is None:
            return
        events = self.engine.drain_block_events()
        if events:
            self._deliver(self.on_events, events)

    def _die(self) -> None:
        """The thread is ending: nothing queued may wait forever."""
        with self._dead_lock:
            self.dead = True
        error = EngineDeadError(f"engine {self.name} stopped" + (f": {self.error!r}" if self.error else ""))
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[3].set_running_or_notify_cancel():
                item[3].set_exception(error)
        if self.error is not None and self.on_dead is not None and not (self.loop and self.loop.is_closed()):
            try:
                self._deliver(self.on_dead, self.error)
            except RuntimeError:  # the loop closed meanwhile: nobody is left to tell
                pass
