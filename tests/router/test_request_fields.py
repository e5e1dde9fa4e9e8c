"""Every field of OpenAI's request schema (as the installed `openai` SDK types it) is
honoured, accepted or refused with 400 as request_fields.py says, none silently ignored;
unknown fields are named in a header; docs/api.md lists exactly what the code does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from splitserve.router import request_fields as F
from splitserve.router.errors import APIError
from splitserve.router.protocol import parse_chat_request, parse_completion_request

MODEL = "m"
MESSAGES = [{"role": "user", "content": "hi"}]

# a value of each field that asks for something (not a neutral default)
USED = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {}}], "logit_bias": {"5": 1.5}, "logprobs": True,
    "max_completion_tokens": 5, "max_tokens": 5, "metadata": {"team": "a"}, "modalities": ["text", "audio"],
    "moderation": {"enabled": True}, "n": 2, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5, "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "x"}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 7, "service_tier": "auto",
    "stop": ["x"], "store": True, "stream_options": {"include_usage": True}, "temperature": 0.5,
    "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 2,
    "top_p": 0.5, "user": "u", "verbosity": "low", "web_search_options": {},
    "best_of": 2, "echo": True, "suffix": "x",
}
# where an honoured field's value lands in the parsed request
LANDS = {
    "frequency_penalty": lambda r: r.params.frequency_penalty == 0.5,
    "presence_penalty": lambda r: r.params.presence_penalty == 0.5,
    "logit_bias": lambda r: r.params.logit_bias == {5: 1.5},
    "logprobs": lambda r: r.params.logprobs is not None,
    "top_logprobs": lambda r: r.params.logprobs == 2,
    "max_completion_tokens": lambda r: r.params.max_tokens == 5,
    "max_tokens": lambda r: r.params.max_tokens == 5,
    "n": lambda r: r.params.n == 2, "seed": lambda r: r.params.seed == 7, "stop": lambda r: r.params.stop == ["x"],
    "stream_options": lambda r: r.include_usage, "temperature": lambda r: r.params.temperature == 0.5,
    "top_p": lambda r: r.params.top_p == 0.5, "model": lambda r: r.model == MODEL,
    "messages": lambda r: r.messages[0].content == "hi", "prompt": lambda r: r.prompt == "hello",
    "echo": lambda r: r.echo,
    "tools": lambda r: r.tools.tools == USED["tools"] and r.tools.choice == "auto",
    "tool_choice": lambda r: r.tools.choice == "required" and r.params.structured.kind == "json_schema",
    "parallel_tool_calls": lambda r: r.tools.parallel is False,
    "response_format": lambda r: r.params.structured.kind == "json_object",
}


def sdk_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


def body_with(endpoint: str, name: str) -> dict:
    body = {"model": MODEL, **({"messages": MESSAGES} if endpoint == "chat" else {"prompt": "hello"})}
    if name in ("model", "messages", "prompt"):
        return body
    body[name] = USED[name] if name != "stream" else True
    if name == "stream_options":
        body["stream"] = True
    if name == "top_logprobs":
        body["logprobs"] = True
    if name in ("tool_choice", "parallel_tool_calls"):
        body["tools"] = USED["tools"]
    if endpoint == "completions" and name == "logprobs":
        body[name] = 2
    return body


CASES = [("chat", n) for n in sorted(sdk_fields(chat_create_params))] + \
        [("completions", n) for n in sorted(sdk_fields(completion_create_params))]


def test_the_tables_cover_exactly_the_sdk_request_fields():
    assert set(F.CHAT_FIELDS) | {"stream"} == sdk_fields(chat_create_params)
    assert set(F.COMPLETION_FIELDS) | {"stream"} == sdk_fields(completion_create_params)


@pytest.mark.parametrize("endpoint,name", CASES)
def test_every_openai_field_is_honoured_accepted_or_refused(endpoint, name):
    table = F.CHAT_FIELDS if endpoint == "chat" else F.COMPLETION_FIELDS
    kind = table.get(name, F.HONOURED)  # `stream` is in neither table: always honoured
    parse = parse_chat_request if endpoint == "chat" else parse_completion_request
    body = body_with(endpoint, name)
    if kind == F.REFUSED:
        with pytest.raises(APIError) as err:
            parse(body, [MODEL])
        assert err.value.status == 400 and err.value.code == "unsupported_parameter" and err.value.param == name
        return
    req = parse(body, [MODEL])
    assert req.ignored_fields == []
    if kind == F.HONOURED and name in LANDS:
        assert LANDS[name](req), (endpoint, name)
    if name == "stream":
        assert req.stream


def test_unknown_fields_are_named_in_the_header_and_logged_once(caplog):
    F._warned.discard("frobnicate")
    body = {"model": MODEL, "messages": MESSAGES, "frobnicate": 1, "top_k": 3, "guided_whatever": None}
    with caplog.at_level(logging.WARNING, logger="splitserve.router.request_fields"):
        req = parse_chat_request(body, [MODEL])
        parse_chat_request(body, [MODEL])
    assert req.ignored_fields == ["frobnicate", "guided_whatever"] and req.params.top_k == 3  # a vLLM extra
    assert sum("'frobnicate'" in r.message for r in caplog.records) == 1
    assert F.header_value(req.ignored_fields) == "frobnicate,guided_whatever"
    assert F.header_value(["a\r\nSet-Cookie: x", "ok"]) == "ok"  # never a header injection


def test_continuous_usage_stats_is_honoured_with_include_usage():
    def parse(options):
        return parse_chat_request({"model": MODEL, "messages": MESSAGES, "stream": True,
                                   "stream_options": options}, [MODEL])

    assert parse({"include_usage": True, "continuous_usage_stats": True}).continuous_usage
    assert not parse({"include_usage": False, "continuous_usage_stats": True}).continuous_usage  # as vLLM
    assert not parse({"include_usage": True}).continuous_usage
    with pytest.raises(APIError) as err:
        parse({"include_usage": True, "continuous_usage_stats": "yes"})
    assert err.value.code == "invalid_type" and err.value.param == "stream_options.continuous_usage_stats"


def test_echo_with_logprobs_is_refused_not_half_done():
    with pytest.raises(APIError) as err:
        parse_completion_request({"model": MODEL, "prompt": "hello", "echo": True, "logprobs": 1}, [MODEL])
    assert err.value.code == "unsupported_parameter" and err.value.param == "echo"


def test_docs_list_the_fields_as_the_code_does():
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    assert F.markdown_tables() in doc, "docs/api.md is stale: python -m splitserve.router.request_fields"
