"""A chat history with tool definitions, assistant tool calls, tool results, reasoning and
chat_template_kwargs renders exactly as transformers' apply_chat_template renders it (text
and token ids), after the router parsed it from OpenAI's format."""

import json

import pytest
from transformers import AutoTokenizer

from splitserve.core.tokenizer import Tokenizer
from splitserve.router.protocol import parse_chat_request
from tests.helpers.chat_templates import QWEN3_STYLE, with_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

OPENAI_HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9 C, rain"},
    {"role": "assistant", "content": "Let me check the time.", "reasoning_content": "They also asked the time.",
     "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "14:05"},
    {"role": "assistant", "content": "Paris 21 C sunny, Oslo 9 C rain; 14:05."},
    {"role": "user", "content": "Thanks. Tomorrow?"},
]


def hf_history() -> list[dict]:
    """The same history in transformers' documented form: arguments as objects."""
    out = json.loads(json.dumps(OPENAI_HISTORY))
    for m in out:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.fixture(scope="module")
def model(make_ckpt, tmp_path_factory):
    return with_template(make_ckpt("llama"), tmp_path_factory.mktemp("tpl") / "qwen3-style", QWEN3_STYLE)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
@pytest.mark.parametrize("with_tools", [True, False])
def test_history_with_tool_calls_renders_as_transformers_does(model, kwargs, with_tools):
    body = {"model": "m", "messages": OPENAI_HISTORY, **({"tools": [WEATHER, TIME]} if with_tools else {}),
            **({"chat_template_kwargs": kwargs} if kwargs else {})}
    req = parse_chat_request(body, ["m"])
    ours = Tokenizer(model)
    tools = req.tools.tools if req.tools else None
    text = ours.apply_chat_template(req.messages_for_template(), True, tools, req.template_kwargs)
    hf = AutoTokenizer.from_pretrained(str(model))
    expected = hf.apply_chat_template(hf_history(), tools=[WEATHER, TIME] if with_tools else None,
                                      add_generation_prompt=True, tokenize=False, **kwargs)
    assert text == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\n9 C, rain\n</tool_response>" in text
    assert "<think>\nThey also asked the time.\n</think>\n\nLet me check the time." in text
    assert ("<tools>" in text) == with_tools and ("<think>\n\n</think>" in text) == bool(kwargs)
    assert ours.encode_chat(req.messages_for_template(), True, tools, req.template_kwargs) == \
        hf.apply_chat_template(hf_history(), tools=[WEATHER, TIME] if with_tools else None,
                               add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
