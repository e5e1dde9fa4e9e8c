"""An LLMEngine on its own thread, driven from asyncio.

The engine is single-threaded by design; workers are asyncio servers. Calls are
queued to the engine thread and answered through futures; every step's outputs
and KV events are handed back to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from splitserve.engine.block_manager import BlockEvent
from splitserve.engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[RequestOutput]], None],
                 on_events: Callable[[list[BlockEvent]], None] | None = None):
        self.engine = engine
        self.loop = loop
        self.on_outputs = on_outputs
        self.on_events = on_events
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable, *args, **kwargs):
        """Run fn(*args) on the engine thread (between steps) and return its result."""
        fut: Future = Future()
        self._commands.put((fn, args, kwargs, fut))
        return await asyncio.wrap_future(fut, loop=self.loop)

    def _run_command(self, item) -> None:
        fn, args, kwargs, fut = item
        try:
            fut.set_result(fn(*args, **kwargs))
        except Exception as exc:  # handed to the caller
            fut.set_exception(exc)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._run_commands(wait=not self.engine.has_unfinished_requests())
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a broken step must not leave clients hanging
                    log.exception("engine step failed; aborting every running request")
                    self.error = exc
                    outputs = self._fail_all()
                self.steps += 1
                if outputs:
                    self.loop.call_soon_threadsafe(self.on_outputs, outputs)
            self._flush_events()

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

    def _flush_events(self) -> None:
        if self.on_events is None:
            return
        events = self.engine.block_manager.drain_events()
        if events:
            self.loop.call_soon_threadsafe(self.on_events, events)

    def _fail_all(self) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.engine.sequences):
            seq = self.engine.sequences[rid]
            self.engine.abort(rid)
            outputs.append(self.engine._output(seq, [], []))  # noqa: SLF001 - finish_reason "abort"
        return outputs
