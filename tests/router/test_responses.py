"""Response builders: exact shapes, and the official `openai` client talking over real
HTTP to a small aiohttp app built from the protocol and response modules."""

import json

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from splitserve.router import errors, responses
from splitserve.router.errors import APIError
from splitserve.router.protocol import parse_chat_request, parse_completion_request
from splitserve.router.responses import Choice, TokenLogprob, Usage

TOKENS = [TokenLogprob("Hel", -0.5, [("Hel", -0.5), ("He", -1.25)]),
          TokenLogprob("lo é", -0.25, [("lo é", -0.25)])]


def test_usage_carries_cached_tokens():
    assert Usage(10, 3, cached_tokens=8).to_dict() == {
        "prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_logprobs_shape():
    assert responses.completion_logprobs(TOKENS, text_offset=5) == {
        "tokens": ["Hel", "lo é"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5, "He": -1.25}, {"lo é": -0.25}],
        "text_offset": [5, 8]}


def test_chat_logprobs_shape():
    out = responses.chat_logprobs(TOKENS)
    assert out["content"][1] == {
        "token": "lo é", "logprob": -0.25, "bytes": [108, 111, 32, 195, 169],
        "top_logprobs": [{"token": "lo é", "logprob": -0.25, "bytes": [108, 111, 32, 195, 169]}]}


def test_builders_parse_as_openai_types():
    usage = Usage(5, 2, 4)
    c = Completion.model_validate(responses.completion_response(
        "cmpl-1", "demo", 1700000000, [Choice(0, "Hello", "length", TOKENS)], usage))
    assert c.choices[0].text == "Hello" and c.choices[0].logprobs.tokens == ["Hel", "lo é"]
    assert c.usage.prompt_tokens_details.cached_tokens == 4
    cc = ChatCompletion.model_validate(responses.chat_completion_response(
        "chatcmpl-1", "demo", 1700000000, [Choice(0, "Hi", "stop"), Choice(1, "Yo", "stop")],
        usage))
    assert [ch.message.content for ch in cc.choices] == ["Hi", "Yo"]
    assert cc.choices[0].message.role == "assistant" and cc.usage.total_tokens == 7
    chunk = ChatCompletionChunk.model_validate(responses.chat_chunk(
        "chatcmpl-1", "demo", 1, 0, "", first=True))
    assert chunk.choices[0].delta.role == "assistant"
    last = ChatCompletionChunk.model_validate(responses.usage_chunk(
        "chatcmpl-1", "demo", 1, usage, chat=True))
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens == 4


def test_sse_framing_is_exact():
    assert responses.sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    assert responses.SSE_DONE == b"data: [DONE]\n\n"
    err = errors.rate_limited()
    assert responses.sse_error(err) == b"data: " + err.to_json() + b"\n\n"
    assert responses.new_request_id(chat=True).startswith("chatcmpl-")
    assert responses.models_list(["demo"], 1) == {
        "object": "list",
        "data": [{"id": "demo", "object": "model", "created": 1, "owned_by": "splitserve"}]}


# ---- the real client over real HTTP ------------------------------------------------------
OUTPUT = ["Hel", "lo", " world"]  # what the "model" generates, token by token


async def _serve(request: web.Request) -> web.StreamResponse:
    chat = request.path.endswith("/chat/completions")
    try:
        parse = parse_chat_request if chat else parse_completion_request
        req = parse(await request.read(), ["demo"])
    except APIError as err:
        return web.Response(status=err.status, body=err.to_json(),
                            content_type="application/json")
    rid, created = responses.new_request_id(chat), 1700000000
    n = req.params.n
    usage = Usage(4, len(OUTPUT) * n, cached_tokens=2)
    if not req.stream:
        choices = [Choice(i, "".join(OUTPUT), "length") for i in range(n)]
        build = responses.chat_completion_response if chat else responses.completion_response
        return web.json_response(build(rid, req.model, created, choices, usage))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        for k, tok in enumerate(OUTPUT):
            finish = "length" if k == len(OUTPUT) - 1 else None
            chunk = (responses.chat_chunk(rid, req.model, created, i, tok, finish, first=k == 0)
                     if chat else
                     responses.completion_chunk(rid, req.model, created, i, tok, finish))
            await resp.write(responses.sse(chunk))
    if req.include_usage:
        await resp.write(responses.sse(responses.usage_chunk(rid, req.model, created, usage,
                                                             chat)))
    await resp.write(responses.SSE_DONE)
    return resp


@pytest.fixture
async def client():
    app = web.Application()
    app.router.add_post("/v1/completions", _serve)
    app.router.add_post("/v1/chat/completions", _serve)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k",
                                  max_retries=0) as c:
        yield c
    await server.close()


async def test_openai_client_non_streaming(client):
    out = await client.completions.create(model="demo", prompt=[1, 2, 3], max_tokens=3, n=2)
    assert [c.text for c in out.choices] == ["Hello world"] * 2
    assert out.usage.prompt_tokens_details.cached_tokens == 2
    chat = await client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3)
    assert chat.choices[0].message.content == "Hello world"


async def test_openai_client_streaming_with_usage(client):
    stream = await client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Hello world"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    stream = await client.completions.create(model="demo", prompt="x", stream=True)
    texts = [c.choices[0].text async for c in stream]
    assert texts == OUTPUT


async def test_openai_client_sees_error_bodies(client):
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="demo", prompt="x", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body == {"message": "temperature must be >= 0, got -1.0",
                               "type": "invalid_request_error", "param": "temperature",
                               "code": "invalid_value"}
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope",
                                             messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    # the extra_body fields other routers add are accepted and ignored
    out = await client.completions.create(model="demo", prompt="x",
                                          extra_body={"priority": 3, "lora": None})
    assert out.choices[0].text == "Hello world"


def test_error_json_is_the_openai_shape():
    assert json.loads(errors.authentication_failed().to_json())["error"]["type"] == \
        "authentication_error"
    assert errors.authentication_failed().status == 401
    assert errors.rate_limited().status == 429
    assert errors.service_unavailable("no decode worker").status == 503
    assert errors.route_not_found("GET", "/v2/x").code == "unknown_url"
