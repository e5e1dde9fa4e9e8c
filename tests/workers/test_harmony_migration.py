"""A gpt-oss chat stream cut mid-reasoning by a migration resumes in its channel: two real
decode workers behind the router (RouterServer over migration_pair's Dispatcher), the first
failing at its 8th step (fault injection) while the answer is in harmony's analysis channel.
The request carries a `response_format`, so the resumed worker also feeds the tokens so far
to a fresh grammar (the harmony turn's, router/harmony_structured.py). The client's stream
adds up to the same `reasoning_content` / `content` / `finish_reason` as the same request
served without a fault, and to the non-streamed answer."""

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from splitserve.engine import EngineConfig
from splitserve.engine.faults import ENV
from splitserve.router.server import RouterServer, ServerConfig
from tests.e2e.test_harmony_serve import write_checkpoint
from tests.helpers.migration_pair import MODEL_ID, migration_pair, to

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "max_tokens": 24, "temperature": 0, "reasoning_effort": "high",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("harmony_migration") / "ckpt")


async def answer(client, stream: bool) -> tuple[dict, str | None, str]:
    resp = await client.post("/v1/chat/completions", data=json.dumps({**BODY, "stream": stream}),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    if not stream:
        body = await resp.json()
        msg = body["choices"][0]["message"]
        return ({"reasoning_content": msg["reasoning_content"], "content": msg["content"]},
                body["choices"][0]["finish_reason"], resp.headers["X-Splitserve-Workers"])
    parts, finish = {"reasoning_content": "", "content": ""}, None
    async for line in resp.content:
        if line.startswith(b"data: {"):
            choice = json.loads(line[6:])["choices"][0]
            assert not ("content" in choice["delta"] and "reasoning_content" in choice["delta"])
            for key in parts:
                parts[key] += choice["delta"].get(key) or ""
            finish = choice["finish_reason"] or finish
    return {k: v or None for k, v in parts.items()}, finish, ""


async def test_a_stream_cut_mid_reasoning_resumes_in_the_analysis_channel(model, monkeypatch):
    monkeypatch.setenv(ENV, json.dumps([{"engine": "d-fail", "fault": "raise", "at_step": 8}]))
    async with migration_pair(EngineConfig(model=str(model), num_kv_blocks=64)) as (dispatcher, workers):
        server = RouterServer(ServerConfig(str(model), MODEL_ID), dispatcher)
        assert server.harmony
        route = {"to": "d-ok"}

        async def decide(prompt, wait, on_wait=None, lora=None):
            return to(route["to"])

        monkeypatch.setattr(dispatcher, "decide_waiting", decide)
        migrations = dispatcher.metrics.request_migrations
        async with TestClient(TestServer(server.app(), host="127.0.0.1")) as client:
            undisturbed = await answer(client, stream=True)
            whole, whole_finish, served_by = await answer(client, stream=False)
            before = sum(s.value for m in migrations.collect() for s in m.samples if s.name.endswith("_total"))
            route["to"] = "d-fail"
            moved = await answer(client, stream=True)
            after = sum(s.value for m in migrations.collect() for s in m.samples if s.name.endswith("_total"))
    assert after - before == 1  # the stream did move, after 7 tokens of its answer
    assert "decode=d-ok" in served_by
    reasoning, finish = undisturbed[0]["reasoning_content"], undisturbed[1]
    assert reasoning and len(reasoning) > 20  # the cut (token 8) fell inside the analysis channel
    assert moved[:2] == undisturbed[:2] == (whole, whole_finish)
    assert finish in ("length", "stop")
    if finish == "stop":  # the analysis ended and the final channel holds the schema's JSON
        assert json.loads(undisturbed[0]["content"]) in ({"ok": True}, {"ok": False})
