"""`/v1/responses` for a gpt-oss (harmony) model: the request goes through harmony's rendering
and its output through harmony's parser (router/harmony_chat.py), as chat completions do.
The analysis channel comes back as a reasoning item, a commentary call to `functions.X` as a
function_call item, the final channel as the message; `reasoning.effort` reaches harmony's
system message. The harness is tests/router/test_openai_responses.py's (a scripted decode
stream); the tokenizer and fixed turns are tests/router/test_harmony.py's."""

from __future__ import annotations

import json

import pytest

from splitserve.router import harmony
from tests.helpers.harmony_tokenizer import write_harmony_tokenizer
from tests.router.test_harmony import CALL_TURN, CONFIG, DATE, FINAL_TURN, MODEL, ids
from tests.router.test_openai_responses import _stack, chat_prompt

TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("harmony")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return str(write_harmony_tokenizer(d))


@pytest.fixture
async def stack(model_dir, monkeypatch):
    monkeypatch.setattr(harmony, "today", lambda: DATE)
    server, script, client, sdk = await _stack(model_dir, served=MODEL)
    assert server.harmony
    yield script, client, sdk
    await sdk.close()
    await client.close()


async def test_a_tool_call_turn_then_its_result_through_previous_response_id(stack):
    script, client, sdk = stack
    script.texts.append(ids(CALL_TURN))
    first = await sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[TOOL],
                                       instructions="Be brief.", reasoning={"effort": "high"})
    reasoning, call = first.output
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "The user wants weather. Call the tool.")]
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", '{"city": "Paris", "unit": "c"}')
    assert first.status == "completed" and first.reasoning.effort == "high"
    assert script.prompts[-1] == await chat_prompt(client, script, ids(CALL_TURN), model=MODEL, tools=[CHAT_TOOL],
                                                   reasoning_effort="high", messages=[
                                                       {"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Weather in Paris?"}])
    script.texts.append(ids(FINAL_TURN))
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}
    second = await sdk.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[TOOL])
    assert [i.type for i in second.output] == ["reasoning", "message"]
    assert second.output[0].content[0].text == "Think: ünï 🙂." and second.output_text == "It is 21°C ☀️."
    assert script.prompts[-1] == await chat_prompt(client, script, ids(FINAL_TURN), model=MODEL, tools=[CHAT_TOOL],
                                                   messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "The user wants weather. Call the tool.",
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, sunny"}])


async def test_a_streamed_final_turn_splits_reasoning_from_the_answer(stack):
    script, _, sdk = stack
    script.texts.append(ids(FINAL_TURN))
    async with sdk.responses.stream(model=MODEL, input="Weather?", reasoning={"effort": "low"}) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("Think: ünï 🙂.", "It is 21°C ☀️.") == (final.output[0].content[0].text,
                                                                        final.output_text)
    assert {200002, 200012} <= set(script.params[-1].stop_token_ids)  # harmony's <|return|> and <|call|>


async def test_what_harmony_cannot_serve_is_refused_under_the_responses_name(stack):
    _, client, _ = stack
    resp = await client.post("/v1/responses", headers={"Content-Type": "application/json"}, data=json.dumps(
        {"model": MODEL, "input": "x", "reasoning": {"effort": "extreme"}}))
    assert resp.status == 400 and (await resp.json())["error"] == {
        "message": "'reasoning.effort' must be low, medium or high for gpt-oss models, got 'extreme'",
        "type": "invalid_request_error", "param": "reasoning.effort", "code": "invalid_value"}


async def test_text_format_constrains_the_final_channel_through_harmonys_grammar(stack):
    script, _, sdk = stack
    script.texts.append(ids('<|channel|>analysis<|message|>JSON it is.<|end|><|start|>assistant<|channel|>final'
                            '<|message|>{"a": 1}<|return|>'))
    fmt = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}}
    out = await sdk.responses.create(model=MODEL, input="JSON please", text={"format": fmt})
    assert out.output_text == '{"a": 1}' and out.output[0].content[0].text == "JSON it is."
    grammar = script.params[-1].structured.spec  # the harmony turn's grammar (router/harmony_structured.py)
    assert '"analysis"' in grammar and '"final"' in grammar
