"""Structured outputs, tool calling and reasoning through `splitserve serve` (1 prefill + 1
decode worker) and the official openai SDK, on the random-weight demo model with a
Qwen3-style chat template (tests/helpers/chat_templates.py): `parse` with a Pydantic model,
streamed and not, prefilled on the decode worker and disaggregated; named, required and
auto tool choices; reasoning_content; bad schemas as 400s. (Migration: tests/reliability.)"""

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
import requests
from pydantic import BaseModel, Field

from splitserve.core.tokenizer import Tokenizer
from splitserve.engine.demo import ensure_demo_checkpoint
from tests.helpers.chat_templates import QWEN3_STYLE, with_template
from tests.helpers.processes import SplitserveProcess

SERVED = "demo-tools"
DISAGG_MIN = 48
LONG = ("Structured outputs constrain every sampled token to a grammar compiled from the schema, so even a model "
        "with random weights answers with JSON that parses and validates. ")


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    tags: list[Annotated[str, Field(max_length=4)]] = Field(min_length=2, max_length=3)


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["C", "F"]


WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    model = with_template(ensure_demo_checkpoint(), tmp_path_factory.mktemp("ckpt") / "demo-qwen3-style", QWEN3_STYLE)
    proc = SplitserveProcess("serve", ["--model", str(model), "--served-model-name", SERVED, "--strict-disaggregation", "--prefill-workers", "1",
                                       "--decode-workers", "1", "--num-kv-blocks", "256",
                                       "--disagg-min-uncached-tokens", str(DISAGG_MIN)])
    proc.model = model
    yield proc
    proc.stop()
    assert proc.proc.returncode == 0, proc.log()[-3000:]


def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.base_url + "/v1", api_key="unused", max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def served_by(raw) -> dict:
    return dict(part.split("=", 1) for part in raw.headers["x-splitserve-workers"].split("; "))


def routed(serve, path: str) -> float:
    lines = requests.get(serve.base_url + "/metrics", timeout=10).text.splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines
               if ln.startswith("splitserve_router_requests_total{") and f'path="{path}"' in ln)


@pytest.mark.parametrize("prompt,path", [("Who is it?", "local"), (LONG, "disaggregated")])
def test_parse_returns_the_pydantic_object(serve, prompt, path):
    tok = Tokenizer(serve.model)
    assert (len(tok.encode(prompt)) >= DISAGG_MIN + 20) == (path == "disaggregated")
    raw = client(serve).chat.completions.with_raw_response.parse(
        model=SERVED, messages=ask(prompt), response_format=Person, temperature=0, max_completion_tokens=300)
    done = raw.parse()
    who = served_by(raw)
    assert who["prefill"].startswith("prefill-") == (path == "disaggregated"), who
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("prompt,path", [("Who else?", "local"), ("Another one. " + LONG, "disaggregated")])
def test_streamed_parse_returns_the_pydantic_object(serve, prompt, path):
    before = routed(serve, path)
    with client(serve).chat.completions.stream(model=SERVED, messages=ask(prompt), response_format=Person,
                                               temperature=0.8, seed=3, max_completion_tokens=300) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert routed(serve, path) == before + 1
    assert "content.delta" in kinds and kinds.count("content.done") == 1
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, Person) and final.choices[0].finish_reason == "stop"


def test_named_tool_choice_returns_arguments_valid_against_the_schema(serve):
    out = client(serve).chat.completions.create(
        model=SERVED, messages=ask("Weather in Oslo?"), tools=TOOLS, temperature=1.0, seed=5,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_completion_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


def test_streamed_named_tool_choice_parses_into_the_pydantic_model(serve):
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    with client(serve).chat.completions.stream(
            model=SERVED, messages=ask("Weather in Rome?"), tools=[tool], temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_completion_tokens=200) as s:
        argument_deltas = sum(event.type == "tool_calls.function.arguments.delta" for event in s)
        final = s.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather) and argument_deltas >= 2
    assert final.choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_calls_one_of_the_tools(serve):
    out = client(serve).chat.completions.create(
        model=SERVED, messages=ask("Anything."), tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_completion_tokens=200)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and out.choices[0].finish_reason == "tool_calls"
    if call.function.name == "get_weather":
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)


FORCED_CALL = r'I will look\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "C"\}\}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_the_template_s_tool_call_block(serve, stream):
    """The model is made to write a Hermes block (a regex it must follow): the router parses it."""
    kwargs = dict(model=SERVED, messages=ask("Weather in Paris?"), tools=TOOLS, tool_choice="auto", temperature=0,
                  max_completion_tokens=100, extra_body={"guided_regex": FORCED_CALL})
    if stream:
        chunks = list(client(serve).chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas] == ["get_weather"]
        calls, finish = deltas, chunks[-1].choices[0].finish_reason
        assert content == "I will look.\n"
    else:
        choice = client(serve).chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
        assert choice.message.content == "I will look.\n"  # what the model wrote before the block, as streamed
    assert finish == "tool_calls" and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "C"}


def test_reasoning_content_is_split_and_chat_template_kwargs_reach_the_template(serve):
    c = client(serve)
    forced = {"guided_regex": r"<think>\nweighing it up\n</think>\n\nSunny\."}
    out = c.chat.completions.create(model=SERVED, messages=ask("Weather?"), temperature=0, max_completion_tokens=40,
                                    extra_body=forced)
    message = out.choices[0].message
    assert message.reasoning_content == "\nweighing it up\n" and message.content == "\n\nSunny."
    thinking_off = c.chat.completions.create(model=SERVED, messages=ask("Weather?"), temperature=0,
                                             max_completion_tokens=5,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    tok = Tokenizer(serve.model)
    assert thinking_off.usage.prompt_tokens == len(tok.encode_chat(ask("Weather?"), template_kwargs={
        "enable_thinking": False})) > out.usage.prompt_tokens


def test_a_schema_that_does_not_compile_is_a_400_naming_it(serve):
    with pytest.raises(openai.BadRequestError) as err:
        client(serve).chat.completions.create(
            model=SERVED, messages=ask("x"), response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert "Invalid type: strin" in err.value.body["message"]
