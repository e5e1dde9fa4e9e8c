"""gpt-oss's harmony format at the router (router/harmony.py, router/harmony_chat.py), through
the real HTTP path with a scripted decode stream in place of a worker (no model needed):

- the prompt token ids the server renders for 12 conversations (system, developer, tools,
  tool results, every reasoning effort) equal openai-harmony's own rendering of the same
  conversation written by hand in harmony's types;
- fixed completions (analysis, a commentary tool call, a final answer, a cut stream, a stream
  that migrates mid-reasoning) come back as the exact OpenAI fields, streamed and not, and
  through the `openai` client;
- structured outputs and forced tool calls: the grammar the worker gets lets the analysis
  channel through and constrains the final text or the call (run by llguidance on tokens);
- the test tokenizer (tests/helpers/harmony_tokenizer.py) encodes text as harmony does.
"""

from __future__ import annotations

import json

import llguidance
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.core.structured import grammar_text
from splitserve.core.tokenizer import Tokenizer
from splitserve.router import harmony
from splitserve.router import server as server_module
from splitserve.router.dispatch import DispatchConfig, Dispatcher, StreamEvent
from splitserve.router.policy import RouteDecision
from splitserve.router.server import RouterServer, ServerConfig
from tests.helpers.harmony_tokenizer import write_harmony_tokenizer

DATE = "2026-12-07"
MODEL = "gpt-oss"
# a config the router reads (it loads no weights): the harmony tokenizer makes it a harmony model
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 201088, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "eos_token_id": [200002, 199999, 200012], "bos_token_id": 199998}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no description, no parameters
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


# ---- harmony's own rendering, written by hand ---------------------------------------------------
def h_system(effort: str | None = None, tools: bool = False) -> Message:
    c = SystemContent.new().with_conversation_start_date(DATE)
    if effort:
        c = c.with_reasoning_effort({"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM,
                                     "high": ReasoningEffort.HIGH}[effort])
    if not tools:
        c = c.with_channel_config(ChannelConfig.require_channels(["analysis", "final"]))
    return Message.from_role_and_content(Role.SYSTEM, c)


def h_developer(instructions: str | None = None, tools: list[dict] | None = None) -> Message:
    c = DeveloperContent.new()
    if instructions:
        c = c.with_instructions(instructions)
    if tools:
        c = c.with_function_tools([ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                                       t["function"].get("parameters")) for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, c)


def h(role: Role, text: str, channel: str | None = None) -> Message:
    m = Message.from_role_and_content(role, text)
    return m.with_channel(channel) if channel else m


def h_call(name: str, args: str) -> Message:
    return (h(Role.ASSISTANT, args, "commentary").with_recipient(f"functions.{name}")
            .with_content_type("<|constrain|>json"))


def h_result(name: str, text: str) -> Message:
    return (Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), text)
            .with_channel("commentary").with_recipient("assistant"))


U = Role.USER
A = Role.ASSISTANT
# (request fields, the same conversation in harmony's types)
CONVERSATIONS = [
    ({"messages": [{"role": "user", "content": "Hi"}]}, [h_system(), h(U, "Hi")]),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
      "reasoning_effort": "low"}, [h_system("low"), h_developer("Be brief."), h(U, "Hi")]),
    ({"messages": [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
      "reasoning_effort": "high"}, [h_system("high"), h_developer("Answer in French."), h(U, "Hello")]),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "No lists."},
                   {"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}],
      "reasoning_effort": "medium"},
     [h_system("medium"), h_developer("Be brief.\n\nNo lists."), h(U, "Two parts")]),
    ({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]},
     [h_system(tools=True), h_developer(tools=[WEATHER]), h(U, "Weather in Paris?")]),
    ({"messages": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
      "tools": [WEATHER], "reasoning_effort": "high"},
     [h_system("high", tools=True), h_developer(tools=[WEATHER]), h(U, "Weather in Paris?"),
      h_call("get_weather", '{"city": "Paris"}'), h_result("get_weather", '{"temp": 21}')]),
    ({"messages": [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
                   {"role": "user", "content": "and 3+3?"}], "reasoning_effort": "low"},
     [h_system("low"), h(U, "2+2?"), h(A, "Simple sum.", "analysis"), h(A, "4", "final"), h(U, "and 3+3?")]),
    ({"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "tool_choice": "none"},
     [h_system(), h(U, "Weather?")]),
    ({"messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather and time?"},
                   {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2],
                    "reasoning_content": "Two calls."},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                   {"role": "tool", "tool_call_id": "call_2", "content": "noon"}],
      "tools": [WEATHER, TIME], "reasoning_effort": "medium"},
     [h_system("medium", tools=True), h_developer("Use tools.", [WEATHER, TIME]), h(U, "Weather and time?"),
      h(A, "Two calls.", "analysis"), h_call("get_weather", '{"city": "Paris"}'), h_call("get_time", "{}"),
      h_result("get_weather", "sunny"), h_result("get_time", "noon")]),
    ({"messages": [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL],
                    "reasoning_content": "Need the tool."},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER]},
     [h_system(tools=True), h_developer(tools=[WEATHER]), h(U, "Weather?"), h(A, "Need the tool.", "analysis"),
      h(A, "Let me check.", "commentary"), h_call("get_weather", '{"city": "Paris"}'), h_result("get_weather", "sunny")]),
    ({"messages": [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [CALL2]},
                   {"role": "tool", "name": "get_time", "content": "noon"},
                   {"role": "assistant", "content": "It is noon."}, {"role": "user", "content": "Thanks"}],
      "tools": [TIME], "reasoning_effort": "high"},
     [h_system("high", tools=True), h_developer(tools=[TIME]), h(U, "Time?"), h_call("get_time", "{}"),
      h_result("get_time", "noon"), h(A, "It is noon.", "final"), h(U, "Thanks")]),
    ({"messages": [{"role": "user", "content": "Ünïcödé 🙂 <|start|> text"}], "reasoning_effort": "medium"},
     [h_system("medium"), h(U, "Ünïcödé 🙂 <|start|> text")]),
]


# ---- a router with a scripted decode stream ---------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("harmony")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return write_harmony_tokenizer(d)


class Script:
    """What the decode worker 'generates': chunks of token ids, the last with the finish reason;
    `workers[i]` is the worker sending chunk i (a change is a migration)."""

    def __init__(self):
        self.prompts: list[list[int]] = []
        self.params = []
        self.chunks: list[list[int]] = []
        self.finish = "stop"
        self.workers: list[str] = []

    async def generate(self, rid, prompt, params, decision):
        self.prompts.append(list(prompt))
        self.params.append(params)
        last_worker = None
        for i, chunk in enumerate(self.chunks):
            worker = self.workers[i] if i < len(self.workers) else "d0"
            yield StreamEvent(list(chunk), [], self.finish if i == len(self.chunks) - 1 else None,
                              decode_worker=worker if worker != last_worker else "")
            last_worker = worker


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer(model_dir)


@pytest.fixture
async def router(model_dir, tokenizer, monkeypatch):
    monkeypatch.setattr(harmony, "today", lambda: DATE)
    monkeypatch.setattr(server_module, "Tokenizer", lambda *a: tokenizer)  # o200k's tokenizer.json: loaded once
    server = RouterServer(ServerConfig(str(model_dir), MODEL), Dispatcher(DispatchConfig(model_id=MODEL), InProcBus()))
    script = Script()

    async def decide(prompt, wait, on_wait=None, lora=None):
        return RouteDecision("d0", None, len(prompt), 0, 0, 0, "test", "test")

    monkeypatch.setattr(server.dispatcher, "decide_waiting", decide)
    monkeypatch.setattr(server.dispatcher, "generate", script.generate)
    async with TestClient(TestServer(server.app(), host="127.0.0.1")) as client:
        yield client, script


async def post(client, body: dict):
    return await client.post("/v1/chat/completions", data=json.dumps({"model": MODEL, "max_tokens": 50, **body}),
                             headers={"Content-Type": "application/json"})


def ids(text: str) -> list[int]:
    return harmony.encoding().encode(text, allowed_special="all")


# ---- rendering ----------------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
async def test_the_served_prompt_is_harmonys_rendering(router, i):
    client, script = router
    body, reference = CONVERSATIONS[i]
    script.chunks = [ids("<|channel|>final<|message|>ok<|return|>")]
    resp = await post(client, body)
    assert resp.status == 200, await resp.text()
    want = harmony.encoding().render_conversation_for_completion(Conversation.from_messages(reference), Role.ASSISTANT)
    assert script.prompts[-1] == list(want)
    assert {200002, 200012} <= set(script.params[-1].stop_token_ids)  # <|return|>, <|call|>


@pytest.mark.parametrize("i", [i for i, (body, _) in enumerate(CONVERSATIONS) if "tools" not in body])
async def test_tokenize_renders_chats_as_harmony(router, i):
    """vLLM's /tokenize counts a chat as /v1/chat/completions renders it: harmony's ids here."""
    client, _ = router
    body, reference = CONVERSATIONS[i]
    resp = await client.post("/tokenize", data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    want = harmony.encoding().render_conversation_for_completion(Conversation.from_messages(reference), Role.ASSISTANT)
    assert (await resp.json())["tokens"] == list(want)


def test_the_test_tokenizer_encodes_as_harmony(tokenizer):
    tok = tokenizer
    text = "Hello, world! 12345 ünïcödé  \n\n  tabs\tand CAPS isn't it? 中文字符 🙂 {\"city\": \"Paris\"}"
    assert tok.encode(text, add_special_tokens=False) == harmony.encoding().encode(text)
    assert tok.token_to_id("<|channel|>") == 200005 and tok.token_to_id("<|call|>") == 200012


# ---- parsing ----------------------------------------------------------------------------------------
CALL_TURN = ('<|channel|>analysis<|message|>The user wants weather. Call the tool.<|end|>'
             '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
             '{"city": "Paris", "unit": "c"}<|call|>')
FINAL_TURN = '<|channel|>analysis<|message|>Think: ünï 🙂.<|end|><|start|>assistant<|channel|>final<|message|>It is 21°C ☀️.<|return|>'


async def non_streamed(client, script, text: str, chunking: int = 1, finish: str = "stop", **body):
    tokens = ids(text)
    script.chunks = [tokens[i:i + chunking] for i in range(0, len(tokens), chunking)]
    script.finish = finish
    resp = await post(client, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                               **body})
    assert resp.status == 200, await resp.text()
    return (await resp.json())["choices"][0]


async def streamed(client, script, text: str, chunking: int = 1, finish: str = "stop", workers=()):
    tokens = ids(text)
    script.chunks = [tokens[i:i + chunking] for i in range(0, len(tokens), chunking)]
    script.finish, script.workers = finish, list(workers)
    resp = await post(client, {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                               "stream": True})
    assert resp.status == 200
    deltas, reasons = [], []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: {"):
            choice = json.loads(line[6:])["choices"][0]
            deltas.append(choice["delta"])
            reasons.append(choice["finish_reason"])
    return deltas, reasons


def joined(deltas: list[dict]) -> dict:
    """The message the deltas add up to (as the openai client accumulates them)."""
    out = {"content": None, "reasoning_content": None, "tool_calls": {}}
    for d in deltas:
        for key in ("content", "reasoning_content"):
            if d.get(key):
                out[key] = (out[key] or "") + d[key]
        for call in d.get("tool_calls") or []:
            slot = out["tool_calls"].setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            slot["id"] = call.get("id") or slot["id"]
            slot["name"] = call.get("function", {}).get("name") or slot["name"]
            slot["arguments"] += call.get("function", {}).get("arguments", "")
    out["tool_calls"] = [out["tool_calls"][i] for i in sorted(out["tool_calls"])]
    return out


async def test_a_tool_call_turn(router):
    client, script = router
    choice = await non_streamed(client, script, CALL_TURN)
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {"role": "assistant", "content": None,
                                 "reasoning_content": "The user wants weather. Call the tool.",
                                 "tool_calls": [{"id": call["id"], "type": "function", "function": {
                                     "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]}
    assert call["id"].startswith("call_")
    for chunking in (1, 3, 1000):  # any chunking, one token or the whole turn at once
        deltas, reasons = await streamed(client, script, CALL_TURN, chunking)
        assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
        got = joined(deltas)
        assert got["reasoning_content"] == choice["message"]["reasoning_content"] and got["content"] is None
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
            ("get_weather", '{"city": "Paris", "unit": "c"}')]
        assert not any("content" in d and "reasoning_content" in d for d in deltas)  # one kind per delta


async def test_a_final_answer_turn(router):
    client, script = router
    choice = await non_streamed(client, script, FINAL_TURN)
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "It is 21°C ☀️.", "reasoning_content": "Think: ünï 🙂."}
    deltas, reasons = await streamed(client, script, FINAL_TURN)
    got = joined(deltas)
    assert (got["reasoning_content"], got["content"], got["tool_calls"]) == ("Think: ünï 🙂.", "It is 21°C ☀️.", [])
    assert reasons[-1] == "stop"
    # reasoning streams before content, never mixed
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")


async def test_a_stream_cut_mid_reasoning(router):
    client, script = router
    text = "<|channel|>analysis<|message|>Still thinking about"
    choice = await non_streamed(client, script, text, finish="length")
    assert choice["finish_reason"] == "length"
    assert choice["message"] == {"role": "assistant", "content": None, "reasoning_content": "Still thinking about"}


async def test_a_migration_mid_reasoning_resumes_in_its_channel(router):
    """The decode worker changes inside the analysis message (and again inside the call): the
    choice keeps one parser over all its tokens, so the split is the one without migration."""
    client, script = router
    n = len(ids(CALL_TURN))
    workers = ["d0"] * 5 + ["d1"] * (n - 10) + ["d2"] * 5
    deltas, reasons = await streamed(client, script, CALL_TURN, 1, workers=workers)
    got = joined(deltas)
    assert got["reasoning_content"] == "The user wants weather. Call the tool." and got["content"] is None
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"]] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}')]
    assert reasons[-1] == "tool_calls"


async def test_output_that_breaks_the_format_is_content(router):
    client, script = router
    choice = await non_streamed(client, script, "<|channel|>final<|message|>ok<|end|>plain words")
    assert choice["message"]["content"] == "okplain words"


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"reasoning_effort": "minimal"}, "reasoning_effort"),
    ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages"),
])
async def test_what_harmony_cannot_serve_is_one_400(router, body, param):
    client, _ = router
    resp = await post(client, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **body})
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == param and "\n" not in err["message"]


# ---- constrained turns: the grammar the worker gets, run by llguidance on the real tokens ------------------
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
THINK = "<|channel|>analysis<|message|>Let me think: {not json} <tags>.<|end|><|start|>assistant"
CONSTRAINED = [  # (request fields, turns the grammar accepts, turns it refuses)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
     [THINK + '<|channel|>final<|message|>{"answer":42}', '<|channel|>final<|message|>{"answer":-1}'],
     ['<|channel|>final<|message|>{"answer": 42}', '<|channel|>final<|message|>{"answer":"x"}',
      '<|channel|>final<|message|>Sure: {"answer":42}', '<|channel|>commentary<|message|>{"answer":42}']),
    ({"response_format": {"type": "json_object"}}, ['<|channel|>final<|message|>{"a":[1,2]}'],
     ['<|channel|>final<|message|>[1,2]']),
    ({"guided_choice": ["yes", 'no "way"']}, [THINK + '<|channel|>final<|message|>no "way"'],
     ['<|channel|>final<|message|>maybe']),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     [THINK + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'],
     ['<|channel|>final<|message|>It is sunny.',
      '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}',
      '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"town":"Paris"}']),
    ({"tool_choice": "required"},
     ['<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}',
      THINK + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo","unit":"c"}'],
     ['<|channel|>final<|message|>No call.',
      '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo","unit":"k"}']),
]


@pytest.fixture(scope="module")
def ll_tokenizer(model_dir):
    """As engine/grammar.py builds it for a gpt-oss checkpoint."""
    return llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=201088,
                                  eos_token=[200002, 199999, 200012])


def accepts(ll_tokenizer, spec, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_text(spec), log_level=0)
    return all(matcher.consume_token(t) for t in ids(text)) and matcher.is_accepting()


@pytest.mark.parametrize("i", range(len(CONSTRAINED)))
async def test_constraints_apply_after_the_analysis_channel(router, ll_tokenizer, i):
    client, script = router
    body, good, bad = CONSTRAINED[i]
    script.chunks = [ids("<|channel|>final<|message|>ok<|return|>")]
    resp = await post(client, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **body})
    assert resp.status == 200, await resp.text()
    spec = script.params[-1].structured
    assert spec.kind == "grammar"
    assert [accepts(ll_tokenizer, spec, t) for t in good] == [True] * len(good)
    assert [accepts(ll_tokenizer, spec, t) for t in bad] == [False] * len(bad)


async def test_a_named_call_comes_back_as_tool_calls(router):
    client, script = router
    text = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    choice = await non_streamed(client, script, text, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    assert choice["finish_reason"] == "tool_calls"  # the grammar ended the turn (stop), before any <|call|>
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}


async def test_the_openai_client(router):
    client, script = router
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x")
    script.chunks, script.finish = [ids(CALL_TURN)], "stop"
    out = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                            tools=[WEATHER], reasoning_effort="high")
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "c"}
    assert msg.model_extra["reasoning_content"] == "The user wants weather. Call the tool."
    script.chunks = [[t] for t in ids(FINAL_TURN)]
    stream = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                               stream=True, reasoning_effort="low")
    content = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert content == "It is 21°C ☀️."
    await api.close()


async def test_other_models_refuse_reasoning_effort(make_ckpt):
    """Only harmony's tokenizer makes a harmony model; others have no effort to set (one 400)."""
    server = RouterServer(ServerConfig(str(make_ckpt("llama")), "m"), Dispatcher(DispatchConfig(model_id="m"),
                                                                                 InProcBus()))
    assert not server.harmony
    async with TestClient(TestServer(server.app(), host="127.0.0.1")) as client:
        resp = await client.post("/v1/chat/completions", data=json.dumps({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}),
            headers={"Content-Type": "application/json"})
        error = (await resp.json())["error"]
    assert resp.status == 400
    assert error == {
        "message": "'reasoning_effort' is not supported by this server: use chat_template_kwargs (e.g. "
                   "enable_thinking) for templates that support thinking", "type": "invalid_request_error", "param": "reasoning_effort",
        "code": "unsupported_parameter"}
