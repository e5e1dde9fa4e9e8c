"""The engine loop in a process of its own, as vLLM V1 splits its EngineCore from the API server.

Why: on a thread of the worker process the engine shares one GIL with the worker's event
loop and gRPC threads. Every torch op releases the GIL and every wake-up of another thread
takes it, so a decode step on the CPU cost 30% more than the same step alone (2.96 ms
against 2.27 ms at batch 1, measured; a helper thread that only wakes 2,000 times a second
adds 10%). In its own process the engine has its interpreter to itself.

`EngineProcess` is an `EngineHandle` (engine/handle.py) as `AsyncEngine` is (the calls, by
name over the pipe; `stats`, `health()`, `step_running_s()`, `kv_pool`) and keeps its promises:
- the child runs an ordinary `AsyncEngine` (same command queue, step-failure handling,
  fault injection, death); whatever it would hand to the event loop it sends on a pipe
  instead, batched: one message per loop iteration (outputs, events, step timings, the new
  stats, command results);
- the KV pool lives in shared memory: the KV receiver and sender of the worker read and
  write the very blocks the engine computes with (a CPU tensor; on CUDA the engine stays on a
  thread, see `use_engine_process`);
- the child's death (crash, kill, OOM) is the engine's death: the pipe ends, every pending call
  fails with EngineDeadError and `on_dead` runs, as when the thread dies. The parent's death
  ends the child (its pipe ends; the kernel's parent-death signal as well).
- outputs crossing the pipe carry this step's part only (new tokens and logprobs, finish,
  error): the cumulative fields (`prompt_token_ids`, `token_ids`, `logprobs`, `text`) are
  left empty, so a step's message grows with the batch, not with the context. Workers read
  only the new part (tests/workers/test_engine_process.py holds them to it).
- the child's main thread answers a ping every PING_INTERVAL_S whatever the engine does, so a
  process frozen between steps is seen (`health()`, `--engine-heartbeat-timeout`); a
  tensor-parallel engine's answer says how long its quietest rank process has been silent,
  judged against the same timeout (a frozen rank blocks rank 0 in a collective, not its pings).
(The parent's half of one pipe protocol, calls, reader, heartbeat and death, is one piece;
engine_child.py is the other half.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401 - registers the shared-memory pickling of tensors

from splitserve.engine.allocator import ENV as MALLOC_ENV
from splitserve.engine.allocator import engine_environment, engine_preload
from splitserve.engine.async_engine import EngineDeadError, engine_health, rank_health
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_child import child_main
from splitserve.engine.handle import EngineHandle
from splitserve.engine.stats import EngineStats

START_TIMEOUT_S = 600.0  # a large checkpoint from a slow disk
PING_INTERVAL_S = 0.5  # how often the parent asks the child's main thread for a pong
_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logging.getLogger(__name__).warning(message)


def use_engine_process(config: EngineConfig, requested: bool | None) -> bool:
    """The engine in its own process: asked for, or by default on the CPU. On CUDA it stays on
    a thread: the KV pool would have to cross processes as CUDA IPC memory, which the RDMA
    engine's registration has not been tried with; and there the GPU, not the GIL, sets the pace."""
    if requested is not None:
        return requested
    return torch.device(config.device).type == "cpu"


class EngineProcess(EngineHandle):
    """An EngineHandle whose engine runs in a spawned child process."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop, on_outputs, on_events=None, *,
                 on_dead=None, name: str = "engine", max_step_failures: int = 3, stall_timeout_s: float = 120.0,
                 on_step_failure=None, on_step_timing: Callable[[float, float], None] | None = None,
                 heartbeat_timeout_s: float = 10.0):
        self.config, self.loop, self.name = config, loop, name
        # The child's main thread answers pings whether the engine idles or steps; a process
        # frozen (SIGSTOP, a hung system call) or starved answers nothing. Step timing alone
        # sees only a running step, so an idle frozen engine looked healthy (issue 39).
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.last_pong = time.monotonic()
        self.rank_silence: tuple[float, str] | None = None  # a tensor-parallel engine's, as of the last pong
        self.on_outputs, self.on_events, self.on_dead = on_outputs, on_events, on_dead
        self.on_step_failure, self.on_step_timing = on_step_failure, on_step_timing
        self.stall_timeout_s = stall_timeout_s
        self._kwargs = {"max_step_failures": max_step_failures, "stall_timeout_s": stall_timeout_s}
        ctx = multiprocessing.get_context("spawn")  # never fork a process with threads (and CUDA)
        self._conn, child_conn = ctx.Pipe()
        self._clock = ctx.RawValue("d", 0.0)  # monotonic start of the step in progress, 0: none
        # a tensor-parallel engine starts its rank processes, which a daemonic process may not
        self._process = ctx.Process(target=child_main, name=f"engine-{name}",
                                    daemon=config.tensor_parallel_size == 1,
                                    args=(config, child_conn, self._clock, name, torch.get_num_threads(),
                                          logging.getLogger().getEffectiveLevel(), self._kwargs))
        self._child_conn = child_conn
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self.steps = 0
        self.step_failures = 0
        self.error: BaseException | None = None
        self.dead = False
        self.stats: EngineStats | None = None
        self.model_id = ""
        self.num_total_blocks = 0
        self.kv_pool = None
        self._reader: threading.Thread | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def launch(self) -> EngineProcess:
        """Start the child and wait until its model is loaded (blocking: run it off the loop).
        Raises RuntimeError with the child's reason when it cannot start."""
        library = engine_preload()
        if library is None and os.environ.get(MALLOC_ENV, "auto") == "auto":
            _say_once(f"engine processes run on glibc's malloc: no tcmalloc is installed, and CPU prefill steps "
                      f"are ~15% slower without it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4; "
                      f"{MALLOC_ENV}=system to choose glibc and silence this)")
        with engine_environment(library):
            self._process.start()
        self._child_conn.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"engine process of {self.name} did not start within {START_TIMEOUT_S:.0f}s")
        try:
            (first,) = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(f"engine process of {self.name} exited while starting "
                               f"(exit code {self._process.exitcode}); see its log above") from None
        if first[0] == "start_failed":
            self._process.join(5)
            raise first[1]
        _, self.model_id, self.num_total_blocks, self.kv_pool, self.stats = first
        return self

    def start(self) -> None:
        self.last_pong = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"engine-pipe-{self.name}", daemon=True)
        self._reader.start()
        threading.Thread(target=self._ping, name=f"engine-ping-{self.name}", daemon=True).start()

    def _ping(self) -> None:
        while not self.dead:
            try:
                with self._send_lock:
                    self._conn.send(("ping",))
            except (OSError, ValueError):
                return  # the pipe is closed: the reader reports the death
            time.sleep(PING_INTERVAL_S)

    def heartbeat_age_s(self) -> float:
        """Seconds since the child last answered a ping."""
        return time.monotonic() - self.last_pong

    def stop(self) -> None:
        self.dead = True
        try:
            with self._send_lock:
                self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self.dead

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def cpu_seconds(self) -> float:
        """CPU time of the child so far (all its threads), for /metrics; 0 once it is gone."""
        try:
            fields = Path(f"/proc/{self._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def step_running_s(self) -> float | None:
        started = self._clock.value
        return time.monotonic() - started if started else None

    def health(self) -> tuple[bool, str]:
        """AsyncEngine.health, for the child."""
        ok, why = engine_health("process", self.alive, self.error, self.step_running_s(), self.stall_timeout_s)
        age = self.heartbeat_age_s()
        if ok and self.heartbeat_timeout_s and age > self.heartbeat_timeout_s:
            return False, (f"engine process {self.pid} has not answered a heartbeat for {age:.0f}s (> "
                           f"--engine-heartbeat-timeout {self.heartbeat_timeout_s:g}s): frozen (SIGSTOP, a hung "
                           "system call) or starved of CPU")
        return rank_health(self.rank_silence, self.heartbeat_timeout_s) if ok else (ok, why)

    # ---- calls --------------------------------------------------------------------------
    async def _invoke(self, method: str, *args, result: bool = True):
        """The worker's calls (engine/handle.py): one ("call", id, method, args, result wanted)
        message; the child answers ("result", id, error, value) with the iteration that ran it."""
        if self.dead:
            raise EngineDeadError(f"engine {self.name} is dead: {self.error!r}")
        call_id = next(self._ids)
        fut = self.loop.create_future()
        self._calls[call_id] = fut
        try:
            with self._send_lock:
                self._conn.send(("call", call_id, method, args, result))
        except (OSError, ValueError) as exc:
            self._calls.pop(call_id, None)
            raise EngineDeadError(f"engine {self.name}: its process is gone ({exc!r})") from exc
        try:
            return await fut
        except asyncio.CancelledError:
            if self._calls.pop(call_id, None) is not None:
                try:
                    with self._send_lock:  # skipped if it has not run; its cleanup comes after it
                        self._conn.send(("cancel", call_id))
                except (OSError, ValueError):  # the child is gone: nothing left to skip
                    pass
            raise

    # ---- the pipe reader (a thread of the parent) -----------------------------------------
    def _read(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                break
            for msg in batch:
                if msg[0] == "pong":
                    self.last_pong = time.monotonic()
                    self.rank_silence = msg[1]
                elif msg[0] == "timing":
                    self.steps += 1
                    if self.on_step_timing is not None:
                        self.on_step_timing(msg[1], msg[2])
                elif msg[0] == "stats":
                    self.stats = msg[1]
            self._post(self._handle, batch)
        if not self.dead:  # the child ended without a word: killed, OOM, a crash in native code
            self._process.join(5)
            self._post(self._lost, RuntimeError(f"engine process of {self.name} exited "
                                                f"(exit code {self._process.exitcode})"))

    def _post(self, fn, arg) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed: nobody is left to tell
            pass

    def _handle(self, batch: list[tuple]) -> None:
        """On the event loop: one iteration of the child, in its order."""
        for msg in batch:
            kind = msg[0]
            if kind == "outputs":
                self.on_outputs(msg[1])
            elif kind == "events" and self.on_events is not None:
                self.on_events(msg[1])
            elif kind == "result":
                fut = self._calls.pop(msg[1], None)
                if fut is not None and not fut.done():
                    if msg[2] is not None:
                        fut.set_exception(msg[2])
                    else:
                        fut.set_result(msg[3])
            elif kind == "step_failed":
                self.step_failures += 1
                if self.on_step_failure is not None:
                    self.on_step_failure(msg[1], msg[2])
            elif kind == "dead":
                self._lost(msg[1])

    def _lost(self, error: BaseException) -> None:
        if self.dead and self.error is not None:
            return
        self.dead = True
        self.error = error
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"engine {self.name} stopped: {error!r}"))
        self._calls.clear()
        if self.on_dead is not None:
            self.on_dead(error)
