"""An `n` out of range gets one message whichever check finds it: the sampling parameters'
own range (1-128, the engine's) or this server's (1-16) said different things before."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.router.admission import MAX_CHOICES
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.server import RouterServer, ServerConfig


@pytest.fixture
async def client(make_ckpt):
    server = RouterServer(ServerConfig(str(make_ckpt("llama")), "m"), Dispatcher(DispatchConfig(model_id="m"),
                                                                                 InProcBus()))
    async with TestClient(TestServer(server.app(), host="127.0.0.1")) as c:
        yield c


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1, 129, 1000])
async def test_every_n_out_of_range_gets_the_same_message(client, path, body, n):
    resp = await client.post(path, data=json.dumps({"model": "m", "max_tokens": 4, **body, "n": n}),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"] == {
        "message": f"'n' must be an integer in [1, {MAX_CHOICES}] on this server, got {n}",
        "type": "invalid_request_error", "param": "n", "code": "invalid_value"}
