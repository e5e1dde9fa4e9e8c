"""Tool calls and reasoning in generated text → OpenAI's message parts, whole and streamed
in every split; tool_choice's grammar; bad tools are 400s naming the field."""

import json

import jsonschema
import pytest

from splitserve.core.structured import validate
from splitserve.router.chat_output import ChatOutput
from splitserve.router.errors import APIError
from splitserve.router.reasoning import ReasoningSplitter, prompt_opens_block
from splitserve.router.tool_calls import HERMES, LLAMA3, MISTRAL, AutoToolStream, family_of, parse
from splitserve.router.tools import parse_tools
from tests.helpers.chat_templates import QWEN3_STYLE

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time"}}]

HERMES_OUT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def calls_of(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_families_are_read_from_the_template():
    assert family_of(QWEN3_STYLE) == HERMES
    assert family_of("{{ '[TOOL_CALLS]' }}") == MISTRAL
    assert family_of("{{ '<|python_tag|>' }}") == LLAMA3
    assert family_of("{{ messages }}") is None and family_of(None) is None


@pytest.mark.parametrize("family,text,content,calls", [
    (HERMES, HERMES_OUT, "I will check.\n", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),  # EOS before the tag
    (HERMES, "no calls here", "no calls here", []),
    (HERMES, "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}', "",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    (LLAMA3, "The answer is {x}", "The answer is {x}", []),
    (MISTRAL, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Sure.",
     [("get_weather", {"city": "Rome"})]),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),
])
def test_parse_per_family(family, text, content, calls):
    got_content, got_calls = parse(family, text)
    assert got_content == content and calls_of(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_auto_stream_sends_content_before_the_call_and_the_calls_at_the_end(step):
    stream = AutoToolStream(HERMES)
    pieces = [stream.feed(HERMES_OUT[i:i + step]) for i in range(0, len(HERMES_OUT), step)]
    rest, calls = stream.finish()
    assert "".join(pieces) + rest == "I will check.\n" and "<" not in "".join(pieces)
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    plain = AutoToolStream(HERMES)
    text = "a < b and <tool is not a call"
    assert "".join(plain.feed(text[i:i + 2]) for i in range(0, len(text), 2)) + plain.finish()[0] == text


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_is_split_from_content_in_any_split(step):
    text = "<think>\nfirst, the weather</think>\n\nIt is sunny."
    for opened, source in ((False, text), (True, text.removeprefix("<think>"))):
        splitter = ReasoningSplitter(opened)
        parts = [splitter.feed(source[i:i + step]) for i in range(0, len(source), step)] + [splitter.feed("", True)]
        assert "".join(r for r, _ in parts) == "\nfirst, the weather"
        assert "".join(c for _, c in parts) == "\n\nIt is sunny."
    never_closed = ReasoningSplitter(False)
    assert never_closed.feed("<think>cut sh") == ("cut sh", "") and never_closed.feed("", True) == ("", "")
    plain = ReasoningSplitter(False)
    assert plain.feed("<thi") == ("", "") and plain.feed("s is text", True) == ("", "<this is text")
    assert prompt_opens_block("<|im_start|>assistant\n<think>\n") and not prompt_opens_block("</think>\n\n")


def deltas_of(out: ChatOutput, text: str, step: int) -> list[dict]:
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    return [d for i, p in enumerate(pieces) for d in out.feed(p, final=i == len(pieces) - 1)]


def test_chat_output_reasoning_then_auto_tool_calls():
    tools = parse_tools({"tools": TOOLS})
    text = "<think>need weather</think>\n" + HERMES_OUT
    out = ChatOutput(tools, HERMES, reasoning=True)
    deltas = deltas_of(out, text, 5)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    assert "".join(d.get("content", "") for d in deltas) == "\nI will check.\n"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    message = out.message_dict()
    assert message["reasoning_content"] == "need weather" and len(message["tool_calls"]) == 2
    assert message["tool_calls"][0] == {"id": calls[0]["id"], "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    out = ChatOutput(parse_tools({"tools": TOOLS, "parallel_tool_calls": False}), HERMES)
    deltas = out.feed(HERMES_OUT, final=True)
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["get_weather"]


def test_named_tool_choice_streams_the_arguments_of_one_call():
    tools = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert tools.choice == "named" and json.loads(tools.constraint().spec) == CITY
    out = ChatOutput(tools)
    deltas = deltas_of(out, '{"city":"Oslo"}', 4)
    first = deltas[0]["tool_calls"][0]
    assert first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city":"Oslo"}'
    assert all("id" not in d["tool_calls"][0] for d in deltas[1:])
    assert out.message_dict() == {"role": "assistant", "content": None, "tool_calls": [
        {"id": first["id"], "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}


def test_required_tool_choice_is_an_array_of_calls_under_one_schema():
    tools = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    spec = tools.constraint()
    validate(spec)
    schema = json.loads(spec.spec)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    out = ChatOutput(tools)
    deltas = deltas_of(out, '[{"name":"get_time","parameters":{}}]', 3)
    assert [d["tool_calls"][0]["function"] for d in deltas] == [{"name": "get_time", "arguments": "{}"}]
    assert out.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("body,param,message", [
    ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters",
     "a JSON schema object"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "names the function 'get_weather' twice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be none, auto, required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope', which is not in 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
])
def test_bad_tools_are_400_naming_the_field(body, param, message):
    with pytest.raises(APIError) as err:
        parse_tools(body)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message
