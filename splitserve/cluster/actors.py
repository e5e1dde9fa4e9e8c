"""Ray actors hosting prefill and decode workers (`splitserve serve`, and the prefill
pool in Kubernetes). Each actor runs its worker's asyncio loop on a thread of its own;
routers talk to the worker over gRPC, never through the actor handle."""

from __future__ import annotations

import asyncio
import logging
import threading

import ray


@ray.remote(max_restarts=3, max_task_retries=0)
class WorkerActor:
    """Restarted by Ray (up to 3 times) if its process dies; it then re-registers
    under the same worker id, announcing `cleared` so routers drop stale entries."""

    def __init__(self, role: str, config, torch_threads: int = 1):
        import torch

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        torch.set_num_threads(torch_threads)
        self.role = role
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), daemon=True, name=f"{role}-worker")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"{role} worker {config.worker_id} failed to start: {self._error}") from self._error

    def _run(self, config) -> None:
        asyncio.set_event_loop(self.loop)
        if self.role == "prefill":
            from splitserve.prefill_worker.worker import PrefillWorker as Worker
        else:
            from splitserve.decode_worker.worker import DecodeWorker as Worker
        self.worker = Worker(config)
        try:
            self.loop.run_until_complete(self.worker.start())
        except BaseException as exc:  # noqa: BLE001 - reported by __init__
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    def address(self) -> str:
        return self.worker.address

    def worker_id(self) -> str:
        return self.worker.worker_id

    def describe(self) -> str:
        url = getattr(self.worker, "admin_url", "") or getattr(self.worker, "metrics_url", "")
        kv = getattr(self.worker, "kv_address", "")
        return f"{self.role} worker {self.worker.worker_id}: gRPC {self.worker.address}" + (
            f", KV receiver {kv}" if kv else "") + (f", metrics {url}/metrics" if url else "")

    def drain(self, timeout: float = 600.0) -> bool:
        if self.role != "decode":
            return True
        return asyncio.run_coroutine_threadsafe(self.worker.drain(timeout), self.loop).result()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.worker.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
