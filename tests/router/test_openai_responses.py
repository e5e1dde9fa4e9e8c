"""`/v1/responses` (OpenAI's Responses API) over the chat path: the real router (aiohttp,
parsing, the chat template, ChatOutput, the Responses builders and store) against a
scripted decode worker: the dispatcher's `generate` streams the tokens of a fixed text, so
the answers are exact. The `openai` SDK parses every answer (`responses.create`, its
`stream=True` events and the stricter `responses.stream` helper). A request must render
exactly the prompt of the chat request it stands for (recorded by the script)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types.responses import response_create_params

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.router import responses_api
from splitserve.router import responses_request as F
from splitserve.router.admission import AdmissionConfig
from splitserve.router.dispatch import DispatchConfig, Dispatcher, StreamEvent, WorkerFailure
from splitserve.router.policy import RouteDecision
from splitserve.router.responses_store import ResponseStore, StoreConfig
from splitserve.router.server import RouterServer, ServerConfig
from tests.helpers.chat_templates import QWEN3_STYLE, with_template

JSON = {"Content-Type": "application/json"}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": CITY}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINKING = "<think>\nthe user greets</think>\n\nHello there."


class Script:
    """The decode worker's part: each request streams the tokens of the next text (or list of
    token ids), one per chunk, with 3 cached prompt tokens; max_tokens cuts it ('length')."""

    def __init__(self, server: RouterServer):
        self.tokenizer, self.texts, self.prompts, self.params = server.tokenizer, [], [], []
        self.fail_after: int | None = None  # tokens after which the worker fails, beyond migration
        self.gap = 0.0  # seconds before each token
        server.dispatcher.decide_waiting = self.decide_waiting
        server.dispatcher.generate = self.generate

    async def decide_waiting(self, prompt, wait_s, on_wait=None, lora=None):
        return RouteDecision("d0", None, len(prompt), 0, 0, 0, "scripted", "local")

    async def generate(self, rid, prompt, params, decision):
        self.prompts.append(list(prompt))
        self.params.append(params)
        text = self.texts.pop(0)  # or token ids
        ids = list(text) if isinstance(text, list) else self.tokenizer.encode(text, add_special_tokens=False)
        finish = "length" if len(ids) > params.max_tokens else "stop"
        ids = ids[:params.max_tokens]
        for i, token in enumerate(ids):
            await asyncio.sleep(self.gap)
            if i == self.fail_after:
                raise WorkerFailure(f"request {rid}: decode worker(s) ['d0'] failed (scripted); gave up")
            yield StreamEvent([token], [], finish if i == len(ids) - 1 else None, 3, "d0" if i == 0 else "")


@pytest.fixture(scope="module")
def model_dir(make_ckpt, tmp_path_factory):
    return str(with_template(make_ckpt("llama"), tmp_path_factory.mktemp("tpl") / "qwen3-style", QWEN3_STYLE))


async def _stack(model_dir, store: StoreConfig | None = None, served: str = "m", timeout_s: float | None = None):
    server = RouterServer(ServerConfig(model_dir, served, responses_store=store or StoreConfig(),
                                       admission=AdmissionConfig(request_timeout_s=timeout_s)),
                          Dispatcher(DispatchConfig(model_id=served), InProcBus()))
    script = Script(server)
    client = TestClient(TestServer(server.app(), host="127.0.0.1"))
    await client.start_server()
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
    return server, script, client, sdk


@pytest.fixture
async def stack(model_dir):
    server, script, client, sdk = await _stack(model_dir)
    yield server, script, client, sdk
    await sdk.close()
    await client.close()


async def chat_prompt(client, script, text: str, **body) -> list[int]:
    """The prompt /v1/chat/completions renders for the same conversation."""
    script.texts.append(text)
    resp = await client.post("/v1/chat/completions", data=json.dumps({"model": "m"} | body), headers=JSON)
    assert resp.status == 200, await resp.text()
    return script.prompts[-1]


async def test_string_input(stack):
    server, script, client, sdk = stack
    script.texts.append("Hello there.")
    out = await sdk.responses.create(model="m", input="Hi")
    assert out.object == "response" and out.status == "completed" and out.output_text == "Hello there."
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [(p.type, p.text, p.annotations) for p in item.content] == [("output_text", "Hello there.", [])]
    n_out = len(server.tokenizer.encode("Hello there.", add_special_tokens=False))
    prompt = script.prompts[-1]
    assert out.usage.model_dump() == {
        "input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": None,
                                                              "cache_write_tokens_details": None},
        "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": len(prompt) + n_out}
    assert prompt == await chat_prompt(client, script, "x", messages=[{"role": "user", "content": "Hi"}])
    assert server.tokenizer.decode(prompt, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n" \
                                                                         "<|im_start|>assistant\n"


async def test_message_items_with_instructions(stack):
    _, script, client, sdk = stack
    script.texts.append("Fine.")
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "How "},
                                                              {"type": "input_text", "text": "are you?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Well."}]},
             {"role": "user", "content": "And now?"}]
    out = await sdk.responses.create(model="m", input=items, instructions="Be brief.", temperature=0.5)
    assert out.output_text == "Fine." and out.instructions == "Be brief." and out.temperature == 0.5
    assert script.prompts[-1] == await chat_prompt(client, script, "x", messages=[
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Well."},
        {"role": "user", "content": "And now?"}])


async def test_a_long_input_is_checked_off_the_event_loop_and_renders_the_same(stack, monkeypatch):
    _, script, client, sdk = stack
    monkeypatch.setattr(responses_api, "INLINE_MESSAGES", 8)  # 21 messages: checked in the prompt pool
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(21)]
    script.texts.append("ok")
    assert (await sdk.responses.create(model="m", input=messages)).output_text == "ok"
    assert script.prompts[-1] == await chat_prompt(client, script, "x", messages=messages)


async def test_function_call_round_trip_with_and_without_previous_response_id(stack):
    _, script, client, sdk = stack
    script.texts.append("I will look." + "\n" + CALL_TEXT)
    first = await sdk.responses.create(model="m", input="Weather in Paris?", tools=[TOOL])
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "I will look.\n"
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    script.texts.append("It is sunny.")
    second = await sdk.responses.create(model="m", previous_response_id=first.id, input=[result], tools=[TOOL])
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    chained = script.prompts[-1]
    script.texts.append("It is sunny.")  # the same turn, the conversation sent whole
    whole = [{"role": "user", "content": "Weather in Paris?"}, *(i.model_dump() for i in first.output), result]
    assert (await sdk.responses.create(model="m", input=whole, tools=[TOOL])).output_text == "It is sunny."
    assert script.prompts[-1] == chained
    assert chained == await chat_prompt(client, script, "x", tools=[CHAT_TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "I will look.\n", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}])


async def test_reasoning_items_and_passing_them_back(stack):
    server, script, client, sdk = stack
    script.texts.append(THINKING)
    out = await sdk.responses.create(model="m", input="Hi")
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "\nthe user greets")]
    assert out.output_text == "\n\nHello there."
    assert out.usage.output_tokens_details.reasoning_tokens == len(
        server.tokenizer.encode("\nthe user greets", add_special_tokens=False))
    script.texts.append("Bye.")
    back = [{"role": "user", "content": "Hi"}, *(i.model_dump() for i in out.output), {"role": "user", "content": "Go"}]
    await sdk.responses.create(model="m", input=back)
    assert script.prompts[-1] == await chat_prompt(client, script, "x", messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "\n\nHello there.", "reasoning_content": "\nthe user greets"},
        {"role": "user", "content": "Go"}])


async def test_streamed_events_in_order_build_the_final_response(stack):
    _, script, _, sdk = stack
    script.texts.append(THINKING + "\n" + CALL_TEXT)
    events = [e async for e in await sdk.responses.create(model="m", input="Hi", tools=[TOOL], stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or not k.endswith(".delta")]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    reasoning, message, call = final.output
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        reasoning.content[0].text == "\nthe user greets"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text == \
        "\n\nHello there.\n"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.name == "get_weather"
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [i.id for i in final.output] and events[0].response.status == "in_progress"


async def test_the_sdk_stream_helper_accepts_the_events(stack):
    _, script, _, sdk = stack
    script.texts.append("Hello there, streamed.")
    async with sdk.responses.stream(model="m", input="Hi") as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there, streamed." and len(deltas) > 1


async def test_max_output_tokens_cut_is_incomplete(stack):
    _, script, _, sdk = stack
    script.texts.append("one two three four five six seven")
    out = await sdk.responses.create(model="m", input="Count", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].status == "incomplete" and out.usage.output_tokens == 3
    script.texts.append("one two three four five six seven")
    events = [e async for e in await sdk.responses.create(model="m", input="Count", max_output_tokens=3, stream=True)]
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"


async def test_named_tool_choice_streams_argument_deltas_and_settings_reach_the_chat_request(stack):
    _, script, _, sdk = stack
    script.texts.append('{"city": "Oslo"}')
    events = [e async for e in await sdk.responses.create(
        model="m", input="Weather?", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.25, top_p=0.5, max_output_tokens=40, stream=True)]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments == '{"city": "Oslo"}'
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"city": "Oslo"}'
    params = script.params[-1]
    assert (params.temperature, params.top_p, params.max_tokens) == (0.25, 0.5, 40)
    assert params.structured.kind == "json_schema" and json.loads(params.structured.spec) == CITY
    script.texts.append('{"a": 1}')
    fmt = {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}
    out = await sdk.responses.create(model="m", input="JSON please", text={"format": fmt})
    assert out.output_text == '{"a": 1}' and out.text.format.name == "answer"
    assert script.params[-1].structured.kind == "json_schema"


async def test_a_worker_failure_is_503_or_an_error_event_then_response_failed(stack):
    _, script, client, sdk = stack
    script.fail_after, script.texts = 2, ["never finished", "never finished"]
    with pytest.raises(openai.InternalServerError) as err:
        await sdk.responses.create(model="m", input="x")
    assert err.value.status_code == 503 and err.value.body["code"] == "worker_failure"
    events = [e async for e in await sdk.responses.create(model="m", input="x", stream=True)]
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "worker_failure" and "gave up" in error.message
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error" and failed.response.error.message == error.message
    assert (await client.get(f"/v1/responses/{failed.response.id}")).status == 404  # failed: not stored


async def test_the_deadline_mid_stream_is_an_error_event_then_response_failed(model_dir):
    _, script, client, sdk = await _stack(model_dir, timeout_s=0.5)
    try:
        script.gap, script.texts = 0.1, ["one two three four five six seven eight nine ten eleven twelve"]
        events = [e async for e in await sdk.responses.create(model="m", input="x", stream=True)]
        error, failed = events[-2:]
        assert error.type == "error" and error.code == "request_timeout" and "within its deadline of 0.5s" in \
            error.message
        assert failed.type == "response.failed" and failed.response.error.message == error.message
        assert any(e.type == "response.output_text.delta" for e in events)  # it had begun
        assert events[-3].type == "response.output_item.done" and events[-3].item.status == "incomplete"
    finally:
        await sdk.close()
        await client.close()


async def test_store_get_delete_and_store_false(stack):
    _, script, client, sdk = stack
    script.texts += ["Kept.", "Not kept."]
    kept = await sdk.responses.create(model="m", input="a", metadata={"k": "v"})
    assert (await sdk.responses.retrieve(kept.id)).model_dump() == kept.model_dump()
    assert kept.metadata == {"k": "v"} and kept.store is True
    gone = await sdk.responses.create(model="m", input="b", store=False)
    for rid in (gone.id, "resp_unknown"):
        resp = await client.get(f"/v1/responses/{rid}")
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "response_not_found"
    await sdk.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(kept.id)


async def test_an_evicted_previous_response_is_previous_response_not_found(model_dir):
    server, script, client, sdk = await _stack(model_dir, StoreConfig(max_responses=2))
    try:
        script.texts += ["1", "2", "3"]
        ids = [(await sdk.responses.create(model="m", input=str(i))).id for i in range(3)]
        assert list(server.responses.store.entries) == ids[1:]
        resp = await client.post("/v1/responses", headers=JSON, data=json.dumps(
            {"model": "m", "input": "more", "previous_response_id": ids[0]}))
        assert resp.status == 404 and await resp.json() == {"error": {
            "message": f"Previous response with id '{ids[0]}' not found: responses are stored in the memory of one "
                       "router process, bounded by --responses-store-max and --responses-store-mb (the oldest go "
                       "first); a router restart, or another router replica behind the same load balancer, does not "
                       "have it: send the conversation as input instead.",
            "type": "invalid_request_error", "param": "previous_response_id", "code": "previous_response_not_found"}}
    finally:
        await sdk.close()
        await client.close()


def test_the_store_bound_in_bytes_evicts_the_least_recently_used():
    size = len('{"id": "a"}') + len('[{"text": "' + "x" * 60 + '"}]')  # 85: an entry's JSON
    store = ResponseStore(StoreConfig(max_responses=100, max_mb=(2 * size + 10) / (1 << 20)))
    for rid in ("a", "b", "c"):
        assert store.put({"id": rid}, [{"text": "x" * 60}])
        store.get("a")  # a is used: b goes first
    assert list(store.entries) == ["c", "a"] and store.bytes == 2 * size and store.evicted == 1  # LRU order
    assert not store.put({"id": "huge"}, [{"text": "x" * 400}])  # larger than the whole store
    assert list(store.entries) == ["c", "a"]


REFUSED = [
    ("background", True), ("conversation", "conv_1"), ("include", ["reasoning.encrypted_content"]),
("prompt", {"id": "pmpt_1"}), ("top_logprobs", 2), ("truncation", "auto"),
    ("context_management", [{"type": "compaction"}]), ("moderation", {"model": "omni"}),
    ("background_options", {"completion_window": "2h"}), ("image", {"context_compression": "enabled"}),
    ("access_programs", {"cyber": "standard"}),
]


@pytest.mark.parametrize("name,value", REFUSED)
async def test_each_unserved_field_is_refused_in_one_line(stack, name, value):
    _, _, client, _ = stack
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps({"model": "m", "input": "x", name: value}))
    assert resp.status == 400 and await resp.json() == {"error": {
        "message": f"'{name}' is not supported by this server: {F._REFUSED[name][1]}", "type": "invalid_request_error",
        "param": name, "code": "unsupported_parameter"}}


@pytest.mark.parametrize("body,param,message", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type",
     "tools of type 'web_search': built-in tools are not available; only function tools are served"),
    ({"tools": [TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice",
     "tool_choice of type 'file_search'; only none, auto, required and {\"type\": \"function\", \"name\": ...} are "
     "served"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary",
     "reasoning summaries are not generated; the reasoning itself comes back as a reasoning item's reasoning_text"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "not implemented"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]", "content parts of type 'input_image'; only text is served"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
     "input items of type 'item_reference': item references need the server-side conversation state of OpenAI's "
     "platform; send the item itself"),
])
async def test_unserved_values_inside_fields_are_refused(stack, body, param, message):
    _, _, client, _ = stack
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps({"model": "m", "input": "x", **body}))
    assert resp.status == 400 and await resp.json() == {"error": {
        "message": f"'{param}' is not supported by this server: {message}", "type": "invalid_request_error",
        "param": param, "code": "unsupported_parameter"}}


@pytest.mark.parametrize("body,param,message", [
    ({"reasoning": {"effort": "low"}}, "reasoning.effort", "'reasoning.effort' is not supported for this model: its "
     "chat template takes no reasoning effort (harmony models such as gpt-oss do)"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be an integer >= 1, got 0"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name",
     "'tool_choice' names the function 'nope', which is not in 'tools'"),
    ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name",
     "'tools[0].name' must be 1 to 64 letters, digits, '_' or '-'"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name",
     "'text.format.name' must be 1 to 64 letters, digits, '_' or '-'"),
])
async def test_chat_path_errors_are_named_as_the_responses_request_names_them(stack, body, param, message):
    _, _, client, _ = stack
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps({"model": "m", "input": "x", **body}))
    error = (await resp.json())["error"]
    assert resp.status == 400 and (error["param"], error["message"]) == (param, message), error


async def test_a_conversation_past_the_context_is_refused_naming_input(stack):
    server, _, client, _ = stack
    messages = [{"role": "user", "content": f"turn {i}"} for i in range(301)]
    n = len(server.tokenizer.encode_chat(messages))
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps({"model": "m", "input": messages}))
    assert resp.status == 400 and await resp.json() == {"error": {
        "message": f"This model's maximum context length is 4096 tokens, but the input has {n} tokens. Shorten the "
                   "input.", "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}}


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"), ({"input": [5]}, "input[0]"), ({"input": []}, "input"),
    ({"input": [{"type": "function_call"}]}, "input[0].call_id"),
    ({"input": [{"role": "bot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "reasoning", "content": "x"}]}, "input[0].content"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"), ({"tool_choice": 5}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"), ({"reasoning": {"effort": 5}}, "reasoning.effort"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"metadata": {"k": 5}}, "metadata"), ({"previous_response_id": 5}, "previous_response_id"), ({"store": "yes"}, "store"),
    ({"instructions": 5}, "instructions"), ({"top_p": 7}, "top_p"), ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
])
async def test_bad_bodies_are_one_line_400s_naming_the_field(stack, body, param):
    _, _, client, _ = stack
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps({"model": "m", "input": "x", **body}))
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == param and "\n" not in error["message"], error


async def test_accepted_fields_and_neutral_values_of_refused_ones_pass(stack):
    _, script, client, _ = stack
    script.texts.append("ok")
    body = {"model": "m", "input": "x", "user": "u1", "safety_identifier": "s", "prompt_cache_key": "k",
            "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"}, "service_tier": "auto",
            "max_tool_calls": 3, "background": False, "include": [], "truncation": "disabled", "top_logprobs": 0,
            "conversation": None, "store": False}
    assert set(body) - {"input", "model", "store"} == {n for n, k in F.FIELDS.items() if k == F.ACCEPTED} - {
        "stream_options"} | {"background", "include", "truncation", "top_logprobs", "conversation"}
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps(body))
    assert resp.status == 200 and "X-Splitserve-Ignored-Fields" not in resp.headers
    assert (await resp.json())["output"][0]["content"][0]["text"] == "ok"


async def test_unknown_fields_are_ignored_and_named(stack):
    _, script, client, _ = stack
    script.texts.append("ok")
    resp = await client.post("/v1/responses", headers=JSON, data=json.dumps({"model": "m", "input": "x", "frob": 1}))
    assert resp.status == 200 and resp.headers["X-Splitserve-Ignored-Fields"] == "frob"
    assert resp.headers["X-Splitserve-Workers"] == "decode=d0; prefill=; decode_cached=3; prefill_cached=0"


def test_the_table_covers_the_sdk_fields_and_docs_list_it():
    assert set(F.FIELDS) == set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    from pathlib import Path
    assert F.markdown_table() in (Path(__file__).parents[2] / "docs" / "api.md").read_text()
