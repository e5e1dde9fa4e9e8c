"""Two real decode workers ("d-fail", "d-ok") on 127.0.0.1 and the router's Dispatcher over
an in-process bus: what the migration tests start. A fault armed for "d-fail"
(SPLITSERVE_FAULT_INJECTION) makes a stream routed there move to "d-ok"."""

from __future__ import annotations

import dataclasses
from contextlib import asynccontextmanager

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.policy import RouteDecision

MODEL_ID = "test-model"


def to(worker: str) -> RouteDecision:
    """A route straight to `worker`, as the policy would have chosen it."""
    return RouteDecision(worker, None, 4, 0, 0, 0, "test", "test")


@asynccontextmanager
async def migration_pair(engine: EngineConfig):
    """(dispatcher, [d-fail, d-ok]), both workers on `engine` (its model_id set here); all
    stopped on the way out."""
    engine = dataclasses.replace(engine, model_id=MODEL_ID)
    bus = InProcBus()
    workers = [DecodeWorker(DecodeWorkerConfig(engine, worker_id=w), bus=bus) for w in ("d-fail", "d-ok")]
    for w in workers:
        await w.start()
    dispatcher = Dispatcher(DispatchConfig(model_id=MODEL_ID), bus)
    await dispatcher.start()
    try:
        await dispatcher.sync.refresh()
        yield dispatcher, workers
    finally:
        await dispatcher.stop()
        for w in workers:
            await w.stop()
