"""An `Expect` header: 100-continue works as HTTP/1.1 says; anything else is a 417 in OpenAI's
error format on every route (aiohttp's own answer was plain text; schemathesis found it), and
the OpenAPI document lists that 417."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.server import RouterServer, ServerConfig

BODY = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "n": 0}).encode()


@pytest.fixture
async def client(make_ckpt):
    server = RouterServer(ServerConfig(str(make_ckpt("llama")), "m"), Dispatcher(DispatchConfig(model_id="m"),
                                                                                 InProcBus()))
    async with TestClient(TestServer(server.app(), host="127.0.0.1")) as c:
        yield c


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/responses"), ("POST", "/tokenize"),
                                         ("GET", "/v1/models"), ("GET", "/health")])
async def test_an_unknown_expectation_is_a_json_417(client, method, path):
    resp = await client.request(method, path, data=BODY if method == "POST" else None,
                                headers={"Content-Type": "application/json", "Expect": "'uur)"})
    assert resp.status == 417
    assert (await resp.json())["error"] == {
        "message": "unknown expectation in the Expect header (\"'uur)\"): only 100-continue is supported; drop "
                   "the header", "type": "invalid_request_error", "param": "Expect", "code": "expectation_failed"}


async def test_100_continue_is_answered_before_the_body_and_the_request_goes_on(client):
    """A raw HTTP/1.1 client: the interim 100 arrives while the body is held back, then the
    request is handled as usual (here an `n` of 0: its own 400)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(BODY))
    await writer.drain()
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(BODY)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 400 ")
    writer.close()


async def test_the_openapi_document_lists_the_417_everywhere(client):
    doc = await (await client.get("/openapi.json")).json()
    operations = [op for ops in doc["paths"].values() for op in ops.values()]
    assert operations and all("417" in op["responses"] for op in operations)
