"""The Ray actor hosting a prefill or decode worker (`splitserve serve`, and the prefill
pool in Kubernetes). Each actor runs its worker's asyncio loop on a thread of its own;
routers talk to the worker over gRPC, never through the actor handle. It is given the
worker's class (DecodeWorker or PrefillWorker), so this base package imports neither.

Ray restarts the actor whenever its process dies (no lifetime cap: a worker that fails
once an hour must not be gone for good after three); it then re-registers under the same
worker id, announcing `cleared` so routers drop stale entries. A worker whose engine
died ends its own process (`fatal`) so that Ray restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import ray

from splitserve.worker_base.process import FATAL_EXIT_CODE

log = logging.getLogger(__name__)



@ray.remote(max_restarts=-1, max_task_retries=0)
class WorkerActor:
    def __init__(self, worker_class: type, config, torch_threads: int = 1):
        import torch

        from splitserve.logs import configure_logging

        configure_logging()
        torch.set_num_threads(torch_threads)
        self.role = worker_class.role
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(worker_class, config), daemon=True,
                                        name=f"{self.role}-worker")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"{self.role} worker {config.worker_id} failed to start: {self._error}") from self._error

    def _run(self, worker_class: type, config) -> None:
        asyncio.set_event_loop(self.loop)
        self.worker = worker_class(config)
        try:
            self.loop.run_until_complete(self.worker.start())
        except BaseException as exc:  # noqa: BLE001 - reported by __init__
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.create_task(self._exit_when_fatal())
        self.loop.run_forever()

    async def _exit_when_fatal(self) -> None:
        await self.worker.fatal.wait()
        log.critical("%s worker %s: %s; exiting so that Ray restarts it", self.role, self.worker.worker_id,
                     self.worker.failed)
        try:
            await asyncio.wait_for(self.worker.stop(), timeout=10)
        finally:
            os._exit(FATAL_EXIT_CODE)  # the actor's process: Ray sees it die and restarts the actor

    def address(self) -> str:
        return self.worker.address

    def worker_id(self) -> str:
        return self.worker.worker_id

    def describe(self) -> str:
        kv = getattr(self.worker, "kv_address", "")
        url = self.worker.admin_url
        return f"{self.role} worker {self.worker.worker_id}: gRPC {self.worker.address}" + (
            f", KV receiver {kv}" if kv else "") + (f", metrics {url}/metrics" if url else "") + (
            f", {self.worker.kv_pool_description()}")

    def drain(self, timeout: float = 600.0) -> bool:
        if self.role != "decode":
            return True
        return asyncio.run_coroutine_threadsafe(self.worker.drain(timeout), self.loop).result()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.worker.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
