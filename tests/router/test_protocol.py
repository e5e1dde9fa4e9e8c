"""Request parsing: good bodies map to the right SamplingParams; each bad body gets its
documented 4xx OpenAI error."""

import json

import pytest

from splitserve.router.errors import APIError
from splitserve.router.protocol import (
    check_prompt_length,
    check_token_ids,
    parse_chat_request,
    parse_completion_request,
)

MODEL = "demo"
SERVED = [MODEL]
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"model": MODEL, "prompt": "hello", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": CHAT, **fields}


# (name, endpoint, body, status, type, param, code)
BAD = [
    ("malformed json", "completions", b'{"model": "demo", "prompt": ', 400,
     "invalid_request_error", None, "invalid_json"),
    ("malformed json chat", "chat", b"not json", 400, "invalid_request_error", None,
     "invalid_json"),
    ("NaN is not JSON", "completions", b'{"model": "demo", "prompt": "x", "temperature": NaN}',
     400, "invalid_request_error", None, "invalid_json"),
    ("body not an object", "chat", b"[1, 2]", 400, "invalid_request_error", None,
     "invalid_json"),
    ("missing model", "completions", {"prompt": "x"}, 400, "invalid_request_error", "model",
     "missing_required_parameter"),
    ("missing model chat", "chat", {"messages": CHAT}, 400, "invalid_request_error", "model",
     "missing_required_parameter"),
    ("model not a string", "chat", chat(model=3), 400, "invalid_request_error", "model",
     "invalid_type"),
    ("unknown model", "completions", completion(model="gpt-9"), 404, "not_found_error",
     "model", "model_not_found"),
    ("unknown model chat", "chat", chat(model="gpt-9"), 404, "not_found_error", "model",
     "model_not_found"),
    ("missing prompt", "completions", {"model": MODEL}, 400, "invalid_request_error", "prompt",
     "missing_required_parameter"),
    ("empty prompt", "completions", completion(prompt=""), 400, "invalid_request_error",
     "prompt", "invalid_value"),
    ("prompt wrong type", "completions", completion(prompt={"a": 1}), 400,
     "invalid_request_error", "prompt", "invalid_type"),
    ("prompt negative token id", "completions", completion(prompt=[1, -2]), 400,
     "invalid_request_error", "prompt", "invalid_type"),
    ("batched prompts", "completions", completion(prompt=["a", "b"]), 400,
     "invalid_request_error", "prompt", "unsupported_parameter"),
    ("missing messages", "chat", {"model": MODEL}, 400, "invalid_request_error", "messages",
     "missing_required_parameter"),
    ("empty messages", "chat", chat(messages=[]), 400, "invalid_request_error", "messages",
     "invalid_value"),
    ("messages not a list", "chat", chat(messages="hi"), 400, "invalid_request_error",
     "messages", "invalid_type"),
    ("message without role", "chat", chat(messages=[{"content": "x"}]), 400,
     "invalid_request_error", "messages[0].role", "invalid_value"),
    ("content wrong type", "chat", chat(messages=[{"role": "user", "content": 5}]), 400,
     "invalid_request_error", "messages[0].content", "invalid_type"),
    ("image part", "chat", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     "invalid_request_error", "messages[0].content[0]", "unsupported_parameter"),
    ("negative max_tokens", "completions", completion(max_tokens=-1), 400,
     "invalid_request_error", "max_tokens", "invalid_value"),
    ("zero max_completion_tokens", "chat", chat(max_completion_tokens=0), 400,
     "invalid_request_error", "max_completion_tokens", "invalid_value"),
    ("max_tokens float", "completions", completion(max_tokens=1.5), 400,
     "invalid_request_error", "max_tokens", "invalid_type"),
    ("max_tokens string", "chat", chat(max_tokens="10"), 400, "invalid_request_error",
     "max_tokens", "invalid_type"),
    ("temperature < 0", "completions", completion(temperature=-0.1), 400,
     "invalid_request_error", "temperature", "invalid_value"),
    ("temperature string", "chat", chat(temperature="hot"), 400, "invalid_request_error",
     "temperature", "invalid_type"),
    ("top_p = 0", "completions", completion(top_p=0), 400, "invalid_request_error", "top_p",
     "invalid_value"),
    ("top_p > 1", "chat", chat(top_p=1.5), 400, "invalid_request_error", "top_p",
     "invalid_value"),
    ("top_k < -1", "completions", completion(top_k=-5), 400, "invalid_request_error", "top_k",
     "invalid_value"),
    ("min_p > 1", "chat", chat(min_p=2), 400, "invalid_request_error", "min_p",
     "invalid_value"),
    ("n = 0", "completions", completion(n=0), 400, "invalid_request_error", "n",
     "invalid_value"),
    ("n bool", "chat", chat(n=True), 400, "invalid_request_error", "n", "invalid_type"),
    ("stop number", "completions", completion(stop=5), 400, "invalid_request_error", "stop",
     "invalid_type"),
    ("stop empty string in list", "chat", chat(stop=["ok", ""]), 400, "invalid_request_error",
     "stop", "invalid_value"),
    ("seed string", "completions", completion(seed="1"), 400, "invalid_request_error", "seed",
     "invalid_type"),
    ("completion logprobs bool", "completions", completion(logprobs=True), 400,
     "invalid_request_error", "logprobs", "invalid_type"),
    ("completion logprobs too many", "completions", completion(logprobs=50), 400,
     "invalid_request_error", "logprobs", "invalid_value"),
    ("chat logprobs int", "chat", chat(logprobs=3), 400, "invalid_request_error", "logprobs",
     "invalid_type"),
    ("top_logprobs without logprobs", "chat", chat(top_logprobs=2), 400,
     "invalid_request_error", "top_logprobs", None),
    ("top_logprobs too many", "chat", chat(logprobs=True, top_logprobs=21), 400,
     "invalid_request_error", "top_logprobs", None),
    ("stream not bool", "completions", completion(stream="yes"), 400, "invalid_request_error",
     "stream", "invalid_type"),
    ("stream_options without stream", "chat", chat(stream_options={"include_usage": True}),
     400, "invalid_request_error", "stream_options", None),
    ("ignore_eos not bool", "completions", completion(ignore_eos=1), 400,
     "invalid_request_error", "ignore_eos", "invalid_type"),
    ("stop_token_ids negative", "chat", chat(stop_token_ids=[-1]), 400,
     "invalid_request_error", "stop_token_ids", "invalid_value"),
    ("echo with logprobs unsupported", "completions", completion(echo=True, logprobs=1), 400,
     "invalid_request_error", "echo", "unsupported_parameter"),
    ("presence_penalty out of range", "chat", chat(presence_penalty=2.5), 400, "invalid_request_error",
     "presence_penalty", "invalid_value"),
    ("frequency_penalty not a number", "completions", completion(frequency_penalty="high"), 400,
     "invalid_request_error", "frequency_penalty", "invalid_type"),
    ("repetition_penalty zero", "completions", completion(repetition_penalty=0), 400,
     "invalid_request_error", "repetition_penalty", "invalid_value"),
    ("logit_bias not an object", "chat", chat(logit_bias=[1, 2]), 400, "invalid_request_error", "logit_bias",
     "invalid_type"),
    ("logit_bias key not a token id", "chat", chat(logit_bias={"hello": 5}), 400, "invalid_request_error",
     "logit_bias", "invalid_value"),
    ("logit_bias bias out of range", "completions", completion(logit_bias={"7": 101}), 400,
     "invalid_request_error", "logit_bias", "invalid_value"),
    ("min_tokens above max_tokens", "completions", completion(min_tokens=20, max_tokens=10), 400,
     "invalid_request_error", "min_tokens", "invalid_value"),
    ("tool without a function", "chat", chat(tools=[{"type": "function"}]), 400,
     "invalid_request_error", "tools[0].function", "invalid_type"),
    ("custom tools unsupported", "chat", chat(tools=[{"type": "custom", "custom": {"name": "x"}}]), 400,
     "invalid_request_error", "tools[0].type", "unsupported_parameter"),
    ("user not a string", "completions", completion(user=7), 400, "invalid_request_error",
     "user", "invalid_type"),
]


@pytest.mark.parametrize("name,endpoint,body,status,type_,param,code", BAD,
                         ids=[b[0] for b in BAD])
def test_bad_requests_get_their_documented_error(name, endpoint, body, status, type_, param,
                                                 code):
    parse = parse_completion_request if endpoint == "completions" else parse_chat_request
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as info:
        parse(raw, SERVED)
    err = info.value
    assert (err.status, err.type, err.param, err.code) == (status, type_, param, code)
    body = json.loads(err.to_json())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]  # says what is wrong, never empty


def test_unknown_model_error_lists_what_is_served():
    with pytest.raises(APIError) as info:
        parse_chat_request(chat(model="gpt-9"), ["demo", "other"])
    assert "'gpt-9'" in info.value.message and "demo, other" in info.value.message


@pytest.mark.parametrize("prompt,text,ids", [
    ("hello", "hello", None),
    (["hello"], "hello", None),
    ([1, 2, 3], None, [1, 2, 3]),
    ([[4, 5]], None, [4, 5]),
])
def test_completion_prompt_forms(prompt, text, ids):
    req = parse_completion_request(completion(prompt=prompt), SERVED)
    assert (req.prompt, req.prompt_token_ids) == (text, ids)


def test_completion_defaults_follow_openai():
    req = parse_completion_request(json.dumps(completion()), SERVED)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.logprobs) == (16, 1.0, 1.0, 1, None)
    assert (req.stream, req.include_usage) == (False, False)


def test_completion_parameters_map_to_sampling_params():
    req = parse_completion_request(completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=20, min_p=0.1, n=2, stop="\n", seed=42,
        logprobs=3, ignore_eos=True, stop_token_ids=[2], user="u1", stream=True,
        stream_options={"include_usage": True}, some_router_field={"x": 1}), SERVED)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.n) == (7, 0.0, 0.5, 20,
                                                                             0.1, 2)
    assert (p.stop, p.seed, p.logprobs, p.ignore_eos, p.stop_token_ids) == (["\n"], 42, 3, True,
                                                                            [2])
    assert p.greedy and req.user == "u1" and req.stream and req.include_usage


def test_chat_parameters_and_messages():
    req = parse_chat_request(chat(
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}], "name": "ann"},
                  {"role": "assistant", "content": None}],
        max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=2,
        stop=["x", "y"], unknown_field=1), SERVED)
    assert req.messages_for_template() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab", "name": "ann"},
        {"role": "assistant", "content": ""}]
    assert req.params.max_tokens == 9  # max_completion_tokens wins over max_tokens
    assert req.params.logprobs == 2 and req.logprobs
    assert req.params.stop == ["x", "y"]


def test_chat_defaults():
    req = parse_chat_request(chat(logprobs=True), SERVED)
    assert req.params.max_tokens is None  # up to the context length
    assert req.params.logprobs == 0  # chosen token's logprob only
    assert not parse_chat_request(chat(), None).logprobs  # no served list: no model check


def test_neutral_values_of_unsupported_parameters_are_accepted():
    req = parse_chat_request(chat(tools=[], response_format={"type": "text"}), SERVED)
    assert req.model == MODEL
    parse_completion_request(completion(echo=False, best_of=1, suffix=None), SERVED)


def test_penalties_logit_bias_and_min_tokens_reach_the_sampling_parameters():
    p = parse_chat_request(chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3,
                                logit_bias={"7": -100, "12": 2.5}, min_tokens=3, max_tokens=9), SERVED).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.3)
    assert p.logit_bias == {7: -100.0, 12: 2.5} and p.min_tokens == 3 and p.processes_logits


def test_check_prompt_length():
    assert check_prompt_length(100, 28, 128) == 28
    assert check_prompt_length(100, None, 128) == 28  # the rest of the context
    with pytest.raises(APIError) as info:
        check_prompt_length(100, 29, 128)
    err = info.value
    assert (err.status, err.type, err.param, err.code) == (
        400, "invalid_request_error", "max_tokens", "context_length_exceeded")
    assert "129 tokens (100 in the prompt, 29 for the completion)" in err.message
    with pytest.raises(APIError) as info:
        check_prompt_length(128, None, 128, param="messages")
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")


def test_check_token_ids():
    check_token_ids([0, 31999], 32000)
    with pytest.raises(APIError) as info:
        check_token_ids([5, 32000], 32000)
    assert info.value.status == 400 and "32000" in info.value.message
