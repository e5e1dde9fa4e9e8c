"""With no healthy worker the router waits up to --no-worker-wait for one before 503
(issue 30): a lone worker whose heartbeat came late under CPU starvation dropped out of the
registry for seconds, and every request in that window got 503 instead of a slower answer."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig
from splitserve.router.admission import AdmissionConfig
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.server import RouterServer, ServerConfig

BODY = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture
async def stack(make_ckpt):
    bus = InProcBus()
    dispatcher = Dispatcher(DispatchConfig(model_id="m"), bus)
    await dispatcher.start()
    model = str(make_ckpt("llama"))

    async def client(wait_s: float):
        server = RouterServer(ServerConfig(model, "m", admission=AdmissionConfig(no_worker_wait_s=wait_s)), dispatcher)
        return TestClient(TestServer(server.app(), host="127.0.0.1"))

    yield bus, model, client
    await dispatcher.stop()


async def _post(client) -> tuple[int, dict, float]:
    started = time.monotonic()
    resp = await client.post("/v1/completions", data=json.dumps(BODY), headers={"Content-Type": "application/json"})
    return resp.status, await resp.json(), time.monotonic() - started


async def test_no_worker_at_all_is_503_after_the_wait(stack):
    bus, _, client = stack
    async with await client(0.5) as c:
        status, body, took = await _post(c)
    assert status == 503 and body["error"]["code"] == "no_workers", body
    assert took >= 0.5  # it waited for one


async def test_a_worker_that_registers_during_the_wait_serves_the_request(stack):
    bus, model, client = stack
    worker = DecodeWorker(DecodeWorkerConfig(EngineConfig(model=model, num_kv_blocks=32, model_id="m"),
                                             worker_id="late", engine_process=False), bus=bus)
    async with await client(60.0) as c:
        request = asyncio.create_task(_post(c))
        await asyncio.sleep(0.3)
        assert not request.done()  # waiting, not 503
        await worker.start()
        try:
            status, body, _ = await asyncio.wait_for(request, 60)
        finally:
            await worker.stop()
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body
