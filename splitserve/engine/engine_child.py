"""The child side of engine/engine_process.py: an ordinary `AsyncEngine` in a process of its
own, whose callbacks, stats and step clock go to the worker over a pipe.

What it sends, one batch per loop iteration (one pickle, one write): ("outputs", [...]),
("events", [...]), ("timing", wall, cpu), ("step_failed", request ids, exc),
("result", call id, exc or None, value), ("stats", EngineStats) when they changed,
("dead", exc), ("pong", the tensor-parallel ranks' silence or None). First of all ("ready",
model id, total blocks, KV pool, stats), or ("start_failed", exc). What it reads: ("call", id,
method, args, result wanted) for any call of engine/handle.py's CALLS, ("cancel", id), ("ping",),
("stop",); the pipe's end means the worker is gone.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import pickle
import signal
import threading
from concurrent.futures import Future

import torch
import torch.multiprocessing  # noqa: F401 - the KV pool's tensor crosses as shared memory

from splitserve.engine.async_engine import AsyncEngine, EngineDeadError
from splitserve.engine.config import EngineConfig
from splitserve.engine.handle import CALLS
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.parallel.state import RankLost
from splitserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


def step_part(out):
    """What crosses the pipe of a RequestOutput: this step's part (see the module docstring)."""
    return dataclasses.replace(out, prompt_token_ids=[], token_ids=[], logprobs=[], text="")


# ---- the child ------------------------------------------------------------------------------
class _ChildEngine(AsyncEngine):
    """AsyncEngine whose callbacks, stats and step clock go to the parent."""

    def __init__(self, engine, send, step_clock, **kwargs):
        self._send = send
        # Filled by the engine thread, and by the pipe reader when a call was answered before
        # the reader attached its callback: the lock keeps a result from missing every batch.
        self._pending: list[tuple] = []
        self._pending_lock = threading.Lock()
        self._sent_stats: EngineStats | None = None
        self._clock = step_clock
        super().__init__(engine, None, self._out, self._events, on_dead=self._dead,
                         on_step_failure=self._step_failed, on_step_timing=self._timing,
                         deliver=lambda fn, *args: fn(*args), **kwargs)

    # every assignment of the base class goes through these two
    @property
    def _step_started(self):
        value = self._clock.value
        return value or None

    @_step_started.setter
    def _step_started(self, value):
        self._clock.value = value or 0.0

    @property
    def stats(self) -> EngineStats:
        return self._sent_stats

    @stats.setter
    def stats(self, value: EngineStats) -> None:
        """Set once per loop iteration: the moment to send what the iteration produced."""
        if value != self._sent_stats:
            self._queue(("stats", value))
            self._sent_stats = value
        self.flush()

    def start(self) -> None:
        self._pending.clear()  # the stats of __init__: the ready message carries them
        super().start()

    def _queue(self, msg: tuple) -> None:
        with self._pending_lock:
            self._pending.append(msg)

    def flush(self) -> None:
        if self._pending and self._thread.is_alive():
            with self._pending_lock:
                batch, self._pending = self._pending, []
            try:
                self._send(batch)
            except (TypeError, AttributeError, pickle.PicklingError) as exc:  # a bug, not the engine's death
                log.error("engine %s: a message to the worker cannot be pickled (%r); sending the rest", self.name,
                          exc)
                for msg in batch:
                    try:
                        self._send([msg])
                    except (TypeError, AttributeError, pickle.PicklingError):
                        if msg[0] == "result":  # its caller hears of it rather than waiting forever
                            self._send([("result", msg[1], RuntimeError(f"unpicklable result: {exc!r}"), None)])

    def _out(self, outputs) -> None:
        self._queue(("outputs", [step_part(o) for o in outputs]))

    def _events(self, events) -> None:
        self._queue(("events", events))

    def _timing(self, wall: float, cpu: float) -> None:
        self._queue(("timing", wall, cpu))

    def _step_failed(self, rids, exc) -> None:
        self._queue(("step_failed", rids, _picklable(exc)))

    def _dead(self, error) -> None:
        self._queue(("dead", _picklable(error)))
        self.flush()

    def answer(self, call_id: int, fut: Future, wanted: bool) -> None:
        """A command's result, sent with the iteration that ran it (on the engine thread);
        None unless `wanted` (add_request returns its Sequence, which stays here)."""
        if fut.cancelled():
            return
        exc = fut.exception()
        value = fut.result() if wanted and exc is None else None
        if isinstance(value, RequestOutput):
            value = step_part(value)
        self._queue(("result", call_id, _picklable(exc) if exc else None, value))


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives the pipe (InvalidPromptError must reach the worker as itself)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type a library defines
        return RuntimeError(repr(exc))


SHM_DIR = "/dev/shm"


def check_shared_memory(nbytes: int, shm_dir: str = SHM_DIR) -> None:
    """The KV pool goes to shared memory (a tmpfs at /dev/shm): refuse to start, saying what
    to do, when it does not fit, rather than die of SIGBUS while copying it there (Docker's
    default /dev/shm is 64 MiB)."""
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return  # no /dev/shm to ask: torch will say what it can
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise RuntimeError(f"the KV pool ({nbytes / 2**30:.2f} GiB) does not fit in {shm_dir} ({free / 2**30:.2f} GiB "
                           "free), where the engine process shares it with its worker: give the container a larger "
                           "/dev/shm (docker run --shm-size; a memory-backed emptyDir in Kubernetes, which the "
                           "operator mounts), lower --kv-cache-memory, or run the engine on a thread "
                           "(--engine-loop thread)")


def _close_tiers(engine) -> None:
    """A stop leaves no disk-tier files behind (os._exit runs no finalizer). Bounded by the disk
    thread's timeout; never raises: the process is ending either way."""
    if getattr(engine, "offloader", None) is None:
        return
    try:
        engine.offloader.close()
    except Exception:  # noqa: BLE001
        logging.getLogger(__name__).warning("KV offload: the tiers could not be closed at stop", exc_info=True)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), even if the pipe reader is stuck."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def child_main(config: EngineConfig, conn, step_clock, name: str, torch_threads: int, log_level: int,
                kwargs: dict) -> None:
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the worker stops this process (or its end of the
    # pipe closes), so a KeyboardInterrupt here would only print a traceback per engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from splitserve.logs import configure_logging

    configure_logging(log_level)  # the worker's stderr, the worker's format: one log per worker
    if config.cpu_affinity:  # before torch starts its OpenMP threads: they inherit it
        from splitserve.core.cpus import format_cpus, pin_this_process

        pin_this_process(config.cpu_affinity)
        logging.getLogger(__name__).info("engine %s pinned to CPUs %s", name, format_cpus(config.cpu_affinity))
    from splitserve.engine.allocator import allocator_in_use

    logging.getLogger(__name__).info("engine %s: memory allocator %s", name, allocator_in_use())
    torch.set_num_threads(torch_threads)
    from splitserve.engine.kv_cache import allocate_pools_in_shared_memory
    from splitserve.engine.llm_engine import LLMEngine  # the model runtime: the child only

    allocate_pools_in_shared_memory(check_shared_memory)  # the worker reads the pool: made there at once
    try:
        engine = LLMEngine(config)
        # every rank's pool goes into shared memory (each the same size): the worker's KV transfer reads them
        check_shared_memory(engine.runner.kv_pool.nbytes * config.tensor_parallel_size)
        pool = engine.share_kv_pool()
    except Exception as exc:  # noqa: BLE001 - the parent says why the worker cannot start
        conn.send([("start_failed", _picklable(exc))])
        return
    lock = threading.Lock()

    def send(batch) -> None:
        with lock:
            conn.send(batch)

    child = _ChildEngine(engine, send, step_clock, name=name, **kwargs)
    from splitserve.engine.heap import freeze_startup_heap

    freeze_startup_heap()  # the collector no longer walks the start-up heap at every full collection
    send([("ready", engine.model_id, engine.num_total_blocks, pool, child.stats)])  # the pool's
    # tensor crosses as a handle on the shared memory (torch.multiprocessing), not as a copy
    child.start()
    calls: dict[int, Future] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone: nothing to serve
            _close_tiers(engine)
            os._exit(0)
        kind = msg[0]
        if kind == "ping":  # answered by this thread, whatever the engine thread is doing
            # a tensor-parallel rank gone while the engine idles: dead now, not at the next request;
            # else how long its quietest rank has been silent (frozen, starved): the worker judges
            try:
                engine.executor.check_ranks()
            except RankLost as lost:
                send([("dead", lost)])
            else:
                send([("pong", engine.executor.silence())])
        elif kind == "call":  # one of the handle's calls, by name (engine/handle.py)
            _, call_id, method, args, wanted = msg
            if method not in CALLS:  # a bug in the parent: said to its caller, the engine untouched
                send([("result", call_id, AttributeError(f"{method!r} is not an engine call (handle.CALLS)"), None)])
                continue
            try:
                fut = child.submit(getattr(engine, method), *args)
            except EngineDeadError as exc:
                send([("result", call_id, exc, None)])
                continue
            calls[call_id] = fut
            fut.add_done_callback(lambda f, i=call_id, w=wanted: (calls.pop(i, None), child.answer(i, f, w)))
        elif kind == "cancel":
            fut = calls.pop(msg[1], None)
            if fut is not None:
                fut.cancel()  # only if it has not run yet; then nothing is answered
        elif kind == "stop":
            child.stop(timeout=2)  # a step that hangs must not hold the worker's shutdown
            _close_tiers(engine)
            os._exit(0)
