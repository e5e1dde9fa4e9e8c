"""A worker as a process of its own (cluster mode: one container): start it, print its
banner, then stop on SIGTERM/SIGINT (after `before_stop`, e.g. draining) or exit non-zero
when the worker failed for good, so that Kubernetes restarts the container."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from splitserve.cluster.bus import BusError

log = logging.getLogger(__name__)

FATAL_EXIT_CODE = 3  # the engine died: restart me
STARTUP_FAILED_EXIT_CODE = 1  # misconfigured (port taken, refused by the router...): read the log


def run_worker_process(worker, banner: Callable[[], str],
                       before_stop: Callable[[], Awaitable[object]] | None = None) -> int:
    async def amain() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await worker.start()
        except (OSError, BusError, RuntimeError, ValueError) as exc:  # a clear line, not a traceback
            log.critical("%s worker %s could not start: %s", worker.role, worker.worker_id, exc)
            await _stop_quietly(worker)
            return STARTUP_FAILED_EXIT_CODE
        print(banner(), flush=True)
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(worker.fatal.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for t in waits:
            t.cancel()
        if worker.failed:
            log.critical("%s worker %s: %s; exiting with code %d to be restarted", worker.role, worker.worker_id,
                         worker.failed, FATAL_EXIT_CODE)
            await worker.stop()
            return FATAL_EXIT_CODE
        if before_stop is not None:
            await before_stop()
        await worker.stop()
        return 0

    return asyncio.run(amain())


async def _stop_quietly(worker) -> None:
    """Free what a failed start had already opened (ports, the engine thread)."""
    try:
        await worker.stop()
    except Exception as exc:  # noqa: BLE001 - partly started: some parts were never opened
        log.debug("stopping the partly started worker: %r", exc)
