"""GET /v1/models/{id}, POST /tokenize and POST /detokenize on the router's real aiohttp
app (no workers needed): exact bodies, ids equal to transformers' tokenizer and chat
template, vLLM's field names, and OpenAI-format 4xx for every bad input."""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.router.dispatch import DispatchConfig, Dispatcher
from splitserve.router.prompts import PromptTokenizer
from splitserve.router.server import RouterServer, ServerConfig

SERVED = "org/tiny-llama"  # a "/" as in Hugging Face names: the path must still route
KEY = "sk-tok-1"
MAX_LEN = 64
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model_dir(make_ckpt):
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
async def client(model_dir):
    server = RouterServer(ServerConfig(str(model_dir), SERVED, api_key=KEY, max_model_len=MAX_LEN),
                          Dispatcher(DispatchConfig(model_id=SERVED), InProcBus()))
    async with TestClient(TestServer(server.app(), host="127.0.0.1"),
                          headers={"Authorization": f"Bearer {KEY}"}) as c:
        c.created = server.created
        yield c


async def post(client, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body)
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return resp.status, await resp.json()


def error(message: str, param: str | None, code: str | None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- GET /v1/models/{id} ----------------------------------------------------------------------
async def test_the_served_model_is_retrieved_by_the_openai_sdk(client):
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=KEY, max_retries=0) as sdk:
        raw = await sdk.models.with_raw_response.retrieve(SERVED)  # the SDK percent-encodes the "/"
        assert raw.http_request.url.raw_path == b"/v1/models/org%2Ftiny-llama"
        assert json.loads(raw.text) == {"id": SERVED, "object": "model", "created": client.created, "owned_by": "splitserve"}
        assert raw.parse().id == SERVED
        listed = await sdk.models.with_raw_response.list()
        assert json.loads(listed.text)["data"] == [json.loads(raw.text)]
        with pytest.raises(openai.NotFoundError) as info:
            await sdk.models.retrieve("gpt-4o")
    assert info.value.body == error("The model 'gpt-4o' does not exist on this server; it serves: "
                                    f"{SERVED}. See GET /v1/models.", "model", "model_not_found",
                                    "not_found_error")["error"]


async def test_model_path_with_a_raw_slash_routes_too(client):
    resp = await client.get(f"/v1/models/{SERVED}")
    assert resp.status == 200 and (await resp.json())["id"] == SERVED


# ---- POST /tokenize ---------------------------------------------------------------------------
async def test_tokenize_a_prompt_as_transformers_does(client, hf):
    text = "Hello there, general Kenobi"
    status, body = await post(client, "/tokenize", {"model": SERVED, "prompt": text})
    ids = hf(text)["input_ids"]
    assert ids[0] == hf.bos_token_id  # the BOS the server adds to text prompts is counted
    assert (status, body) == (200, {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                                    "token_strs": None})
    status, body = await post(client, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                                    "return_token_strs": True})  # model is optional (vLLM)
    plain = hf(text, add_special_tokens=False)["input_ids"]
    assert (status, body) == (200, {"count": len(plain), "max_model_len": MAX_LEN, "tokens": plain,
                                    "token_strs": hf.convert_ids_to_tokens(plain)})


async def test_tokenize_messages_through_the_chat_template(client, hf):
    status, body = await post(client, "/tokenize", {"model": SERVED, "messages": CHAT})
    ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (status, body) == (200, {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                                    "token_strs": None})
    status, body = await post(client, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert body["tokens"] == hf.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=True,
                                                    return_dict=False)
    assert body["count"] < len(ids)


async def test_tokenize_refuses_what_it_cannot_honour(client):
    cases = [
        ({"model": SERVED}, 400, error("send 'prompt' (a text) or 'messages' (a chat) to tokenize", "prompt",
                                       "missing_required_parameter")),
        ({"prompt": 5}, 400, error("'prompt' must be a string (send 'messages' to tokenize a chat), got a number (5)",
                                   "prompt", "invalid_type")),
        ({"prompt": "a", "messages": CHAT}, 400,
         error("send either 'prompt' (a text) or 'messages' (a chat), not both", "prompt", None)),
        ({"prompt": "a", "return_token_strs": "yes"}, 400,
         error("'return_token_strs' must be a boolean, got a string", "return_token_strs", "invalid_type")),
        ({"messages": CHAT, "continue_final_message": True}, 400,
         error("'continue_final_message' is not supported by this server: /tokenize renders messages exactly as "
               "/v1/chat/completions does; remove it from the request", "continue_final_message",
               "unsupported_parameter")),
        ({"messages": CHAT, "chat_template": "{{ messages }}"}, 400,
         error("'chat_template' is not supported by this server: /tokenize renders messages exactly as "
               "/v1/chat/completions does; remove it from the request", "chat_template", "unsupported_parameter")),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400,
         error("'messages[0].role' must be one of system, developer, user, assistant, tool, got 'robot'",
               "messages[0].role", "invalid_value")),
        ({"model": "other", "prompt": "a"}, 404,
         error(f"The model 'other' does not exist on this server; it serves: {SERVED}. See GET /v1/models.",
               "model", "model_not_found", "not_found_error")),
        (b'{"prompt": "\\ud800"}', 400,
         error("'prompt' contains an unpaired UTF-16 surrogate (\\ud800-\\udfff); send valid Unicode text",
               "prompt", "invalid_value")),
        (b'{"prompt": ', 400, None),
    ]
    for body, status, expected in cases:
        got_status, got = await post(client, "/tokenize", body)
        assert got_status == status, (body, got)
        if expected is not None:
            assert got == expected, body
        else:
            assert got["error"]["code"] == "invalid_json"


async def test_tokenize_keeps_the_context_limit_and_says_the_count(client, hf):
    text = "word " * 200
    n = len(hf(text)["input_ids"])
    status, body = await post(client, "/tokenize", {"prompt": text})
    assert (status, body) == (400, error(f"This model's maximum context length is {MAX_LEN} tokens, but the prompt "
                                         f"has {n} tokens. Shorten the prompt.", "prompt",
                                         "context_length_exceeded"))


async def test_tokenize_and_detokenize_need_the_api_key(client):
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        resp = await client.post(path, json=body, headers={"Authorization": "Bearer wrong"})
        assert resp.status == 401, path
        assert (await resp.json())["error"]["code"] == "invalid_api_key"


# ---- POST /detokenize -------------------------------------------------------------------------
async def test_detokenize_round_trips_with_special_tokens_kept(client, hf):
    ids = hf("Hello there")["input_ids"]
    status, body = await post(client, "/detokenize", {"model": SERVED, "tokens": ids})
    assert (status, body) == (200, {"prompt": hf.decode(ids)})
    assert body["prompt"].startswith(hf.bos_token)  # as vLLM: special tokens are not skipped
    status, body = await post(client, "/detokenize", {"tokens": []})
    assert (status, body) == (200, {"prompt": ""})


async def test_detokenize_refuses_bad_ids(client, hf):
    vocab = len(hf)
    cases = [
        ({}, error("you must provide a 'tokens' parameter", "tokens", "missing_required_parameter")),
        ({"tokens": "1 2"}, error("'tokens' must be an array of token ids, got a string", "tokens", "invalid_type")),
        ({"tokens": [1, -3]}, error("'tokens[1]' must be a token id (a non-negative integer), got a number (-3)",
                                    "tokens[1]", "invalid_type")),
        ({"tokens": [1, True]}, error("'tokens[1]' must be a token id (a non-negative integer), got a boolean",
                                      "tokens[1]", "invalid_type")),
        ({"tokens": [1, 2.5]}, error("'tokens[1]' must be a token id (a non-negative integer), got a number (2.5)",
                                     "tokens[1]", "invalid_type")),
        ({"tokens": [5, vocab]}, error(f"token id {vocab} (tokens[1]) is out of range: the vocabulary has {vocab} "
                                       "tokens", "tokens", "invalid_value")),
        ({"tokens": [10**30]}, error(f"token id {10**30} (tokens[0]) is out of range: the vocabulary has {vocab} "
                                     "tokens", "tokens", "invalid_value")),
        ({"tokens": [1] * (MAX_LEN + 1)},
         error(f"'tokens' has {MAX_LEN + 1} ids; at most {MAX_LEN} (the context length) are decoded at once",
               "tokens", "invalid_value")),
    ]
    for body, expected in cases:
        assert await post(client, "/detokenize", body) == (400, expected), body


async def test_long_inputs_take_the_prompt_pool_with_the_same_answers(client, hf, monkeypatch):
    from splitserve.router import tokenization

    text = "Hello there, general Kenobi"
    inline = [await post(client, "/tokenize", {"prompt": text, "return_token_strs": True}),
              await post(client, "/detokenize", {"tokens": hf(text)["input_ids"]})]
    monkeypatch.setattr(tokenization, "INLINE_IDS", 2)  # every list of ids is now "long"
    pooled = []
    real_offload = PromptTokenizer.offload

    async def spy(self, fn, *args):
        pooled.append(fn.__name__)
        return await real_offload(self, fn, *args)

    monkeypatch.setattr(PromptTokenizer, "offload", spy)
    assert [await post(client, "/tokenize", {"prompt": text, "return_token_strs": True}),
            await post(client, "/detokenize", {"tokens": hf(text)["input_ids"]})] == inline
    assert pooled == ["token_strings", "decode"]
