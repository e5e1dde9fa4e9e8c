"""gpt-oss chat through `splitserve serve` for real (1 prefill + 1 decode worker): a tiny random
gpt-oss with gpt-oss's real vocabulary (tests/helpers/harmony_tokenizer.py: o200k + the harmony
specials, 201,088 ids), chatted with through the `openai` client.

- the prompt `serve` renders is openai-harmony's (its length is the usage's prompt_tokens, and
  transformers' greedy continuation of exactly those ids is what comes back);
- the answer's fields (`reasoning_content`, `content`, `tool_calls`, `finish_reason`) are
  openai-harmony's parse of transformers' greedy tokens, cut at the first EOS as the engine
  cuts, streamed and not;
- a `response_format` and a named `tool_choice` run under the engine's grammar with harmony's
  special tokens: the answer is valid JSON of the schema in the final channel / a call with
  valid arguments, or a cut analysis (a random model may think until max_tokens).
"""

from __future__ import annotations

import json
import secrets

import openai
import pytest
import requests

from splitserve.router import harmony, harmony_parser
from splitserve.router.protocol import parse_chat_request
from tests.engine.test_gpt_oss import CONFIG
from tests.helpers.harmony_tokenizer import EOS_IDS, VOCAB_SIZE, write_harmony_tokenizer
from tests.helpers.processes import SplitserveProcess
from tests.helpers.reference import hf_greedy
from tests.router.test_harmony import CONVERSATIONS

SERVED = "gpt-oss-tiny"
NEW = 24
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def write_checkpoint(out):
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB_SIZE, architectures=["GptOssForCausalLM"], bos_token_id=199998,
                       eos_token_id=EOS_IDS, pad_token_id=199999, **CONFIG)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    model.save_pretrained(str(out))
    return write_harmony_tokenizer(out)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony_serve")
    model = write_checkpoint(root / "ckpt")
    token = root / "token"
    token.write_text(secrets.token_urlsafe(32))
    serve = SplitserveProcess("serve", ["--model", str(model), "--served-model-name", SERVED,
                                        "--prefill-workers", "1", "--decode-workers", "1", "--num-kv-blocks", "128",
                                        "--cluster-token-file", str(token)])
    try:
        yield model, serve
    finally:
        serve.stop()
    log = serve.log()
    assert serve.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):][:6000]


def expected(model, prompt: list[int]) -> tuple[dict, str]:
    """transformers' greedy tokens, cut at the first EOS as the engine cuts, parsed by harmony."""
    tokens = hf_greedy(model, prompt, NEW)
    cut = next((i + 1 for i, t in enumerate(tokens) if t in EOS_IDS), None)
    parser = harmony_parser.HarmonyParser()
    parser.feed(tokens[:cut])
    reason = "length" if cut is None else ("tool_calls" if parser.calls else "stop")
    nothing = not (parser.content or parser.reasoning or parser.calls)  # e.g. a header never closed
    return {"content": parser.content or ("" if nothing else None), "reasoning_content": parser.reasoning or None,
            "tool_calls": [(c.name, c.arguments) for c in parser.calls]}, reason


def test_chat_through_serve_is_harmonys_render_and_parse(served):
    model, serve = served
    api = openai.OpenAI(base_url=serve.base_url + "/v1", api_key="x")
    date = harmony.today()
    prompt = harmony.render(MESSAGES, [WEATHER], "low")
    out = api.chat.completions.create(model=SERVED, messages=MESSAGES, tools=[WEATHER], reasoning_effort="low",
                                      max_tokens=NEW, temperature=0)
    if harmony.today() != date:
        pytest.skip("the date changed during the request (the system message states it)")
    assert out.usage.prompt_tokens == len(prompt)
    want, reason = expected(model, prompt)
    msg = out.choices[0].message
    got = {"content": msg.content, "reasoning_content": msg.model_extra.get("reasoning_content"),
           "tool_calls": [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]}
    assert (got, out.choices[0].finish_reason) == (want, reason)

    stream = api.chat.completions.create(model=SERVED, messages=MESSAGES, tools=[WEATHER], reasoning_effort="low",
                                         max_tokens=NEW, temperature=0, stream=True)
    parts = {"content": "", "reasoning_content": ""}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        parts["content"] += delta.content or ""
        parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (parts["content"] or None, parts["reasoning_content"] or None, finish) == (
        want["content"] or None, want["reasoning_content"], reason)


def test_every_conversation_is_rendered_by_harmony_through_serve(served):
    """tests/router/test_harmony.py's 12 conversations (their ids there equal openai-harmony's own
    rendering written by hand): served, the prompt is harmony.render's, counted by the usage, and
    /tokenize gives its very ids for those without tools (/tokenize takes no tools)."""
    _, serve = served
    api = openai.OpenAI(base_url=serve.base_url + "/v1", api_key="x")
    for body, _ in CONVERSATIONS:
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        date = harmony.today()
        messages = parse_chat_request({"model": SERVED, **body}).messages_for_template()  # text parts joined
        want = harmony.render(messages, tools, body.get("reasoning_effort"))
        out = api.chat.completions.create(model=SERVED, max_tokens=1, temperature=0, **body)
        if "tools" not in body:
            r = requests.post(serve.base_url + "/tokenize", json=body, timeout=60)
            assert r.json()["tokens"] == want
        if harmony.today() == date:
            assert out.usage.prompt_tokens == len(want)


@pytest.mark.parametrize("kind", ["response_format", "tool_choice"])
def test_constrained_answers_through_serve(served, kind):
    _, serve = served
    api = openai.OpenAI(base_url=serve.base_url + "/v1", api_key="x")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
             if kind == "response_format" else {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    out = api.chat.completions.create(model=SERVED, messages=MESSAGES, tools=[WEATHER], max_tokens=NEW,
                                      temperature=0, **extra)
    choice = out.choices[0]
    if choice.finish_reason == "length":  # still in the analysis channel: nothing else may have come out
        assert choice.message.content is None and not choice.message.tool_calls
        assert choice.message.model_extra["reasoning_content"]
    elif kind == "response_format":
        assert choice.finish_reason == "stop" and json.loads(choice.message.content) in ({"ok": True}, {"ok": False})
    else:
        call = choice.message.tool_calls[0].function
        assert choice.finish_reason == "tool_calls" and call.name == "get_weather"
        assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
