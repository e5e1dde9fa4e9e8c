"""Two real trained models served from the GGUF files their PyPI packages ship (issue 31;
tests/helpers/real_models.py): `splitserve serve --model <file>.gguf`, one serve per model
for the module (SmolLM2 with a prefill and a decode worker, its chat prompts disaggregated;
Gemma 3 colocated). Greedy, 64 tokens, 6 prompts each, token for token against
transformers loading the same file (at least 5 of 6): SmolLM2-135M-Instruct through
/v1/chat/completions with the chat template its GGUF carries, Gemma 3 270M base through
/v1/completions. On SmolLM2: the capital of France is Paris; streaming, structured output
(json_schema) and a tool call.

Tokens are compared through logprobs: the server returns each generated token's text
(decoded alone), the reference's ids are decoded the same way, and the counts must agree;
ignore_eos keeps every answer 64 tokens long. transformers' outputs are cached between runs
(tests/helpers/run_cache.py), keyed by the file's sha256 and the prompts."""

import hashlib
import json
from functools import cache

import jsonschema
import pytest
import requests
import torch

from splitserve.core.tokenizer import Tokenizer
from tests.helpers.processes import SplitserveProcess
from tests.helpers.real_models import COMPLETION_PROMPTS, derived, gemma3_gguf, smollm2_gguf
from tests.helpers.run_cache import cached_json

MAX_TOKENS = 64
DISAGG_MIN = 16  # uncached prompt tokens from which the router sends a prompt to the prefill worker
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a CPU does in two sentences.", "List three fruits that are red.",
                "How do I reverse a list in Python?", "Translate 'good morning' into Spanish and French."]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}


def serve(gguf, layout: list[str]):
    proc = SplitserveProcess("serve", ["--model", str(gguf), *layout], timeout=300)
    yield proc
    proc.stop()
    assert proc.proc.returncode == 0, proc.log()[-3000:]


@pytest.fixture(scope="module")
def smollm2():  # disaggregated: every chat prompt of the token-exact test is prefilled remotely
    yield from serve(smollm2_gguf(), ["--prefill-workers", "1", "--decode-workers", "1",
                                      "--disagg-min-uncached-tokens", str(DISAGG_MIN), "--strict-disaggregation"])


@pytest.fixture(scope="module")
def gemma3():  # colocated
    yield from serve(gemma3_gguf(), ["--prefill-workers", "0", "--decode-workers", "1"])


@cache
def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def reference(gguf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy 64 tokens for each prompt, from the same GGUF file."""
    key = ("gguf-greedy", file_sha256(gguf), prompts, MAX_TOKENS)
    return cached_json("references", key, lambda: _generate(gguf, prompts))


def _generate(gguf, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside a running serve: 5.6 s for 64 SmolLM2 tokens on one thread, 27 s on two
    try:
        with torch.no_grad():
            return [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    finally:
        torch.set_num_threads(threads)


def hf_tokenizer(gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def token_texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def post(proc, path: str, body: dict, workers: dict | None = None) -> dict:
    """The response's JSON; `workers` gets who served it (X-Splitserve-Workers: decode, prefill)."""
    r = requests.post(proc.base_url + path, json={"model": proc_model(proc), **body}, timeout=300)
    assert r.status_code == 200, r.text
    if workers is not None:
        workers.update(part.split("=", 1) for part in r.headers["x-splitserve-workers"].split("; "))
    return r.json()


def proc_model(proc) -> str:
    return requests.get(proc.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def agreement(served: list[list[str]], want: list[list[str]]) -> int:
    return sum(s == w for s, w in zip(served, want, strict=True))


def test_smollm2_chat_is_token_exact_against_transformers(smollm2):
    gguf = smollm2_gguf()
    hf, tok = hf_tokenizer(gguf), Tokenizer(derived(gguf))
    prompts = [hf(hf.apply_chat_template(ask(p), tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"] for p in CHAT_PROMPTS]
    want = [token_texts(tok, ids) for ids in reference(gguf, prompts)]
    served = []
    for text, ids in zip(CHAT_PROMPTS, prompts, strict=True):
        who = {}
        out = post(smollm2, "/v1/chat/completions", {"messages": ask(text), "temperature": 0, "max_tokens": MAX_TOKENS,
                                                     "ignore_eos": True, "logprobs": True}, who)
        assert out["usage"]["prompt_tokens"] == len(ids)  # the GGUF's template, tokenized as transformers does
        assert who["prefill"].startswith("prefill-"), who  # KV computed by the prefill worker, moved to decode
        served.append([e["token"] for e in out["choices"][0]["logprobs"]["content"]])
    assert all(len(s) == MAX_TOKENS for s in served)
    print(f"SmolLM2 chat: {agreement(served, want)} of 6 prompts token-exact")
    assert agreement(served, want) >= 5, [("".join(s), "".join(w)) for s, w in zip(served, want, strict=True) if s != w]


def test_gemma3_completions_are_token_exact_against_transformers(gemma3):
    gguf = gemma3_gguf()
    tok = Tokenizer(derived(gguf))
    # transformers tokenizes these prompts the same, BOS first (tests/engine/test_gguf_model.py: loading
    # its tokenizer from this GGUF takes ~12 s, so it is checked there, where it is loaded anyway)
    prompts = [tok.encode(p) for p in COMPLETION_PROMPTS]
    want = [token_texts(tok, ids) for ids in reference(gguf, prompts)]
    served = []
    for text, ids in zip(COMPLETION_PROMPTS, prompts, strict=True):
        out = post(gemma3, "/v1/completions", {"prompt": text, "temperature": 0, "max_tokens": MAX_TOKENS,
                                               "ignore_eos": True, "logprobs": 0})
        assert out["usage"]["prompt_tokens"] == len(ids)
        served.append(out["choices"][0]["logprobs"]["tokens"])
    assert all(len(s) == MAX_TOKENS for s in served)
    print(f"Gemma 3 completions: {agreement(served, want)} of 6 prompts token-exact")
    assert agreement(served, want) >= 5, [("".join(s), "".join(w)) for s, w in zip(served, want, strict=True) if s != w]


def test_smollm2_knows_the_capital_of_france(smollm2):
    out = post(smollm2, "/v1/chat/completions", {"messages": ask("What is the capital of France?"),
                                                 "temperature": 0, "max_tokens": 32})
    assert "Paris" in out["choices"][0]["message"]["content"]
    assert out["choices"][0]["finish_reason"] == "stop"  # it ends its turn (<|im_end|>)
    assert out["model"] == "SmolLM2-135M-Instruct.Q4_1"  # named after the file


def test_smollm2_streams_what_it_answers_whole(smollm2):
    body = {"messages": ask(CHAT_PROMPTS[1]), "temperature": 0, "max_tokens": 40}
    whole = post(smollm2, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    r = requests.post(smollm2.base_url + "/v1/chat/completions", timeout=120, stream=True,
                      json={"model": proc_model(smollm2), **body, "stream": True})
    assert r.status_code == 200
    deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
              for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ") and line != "data: [DONE]"]
    assert len([d for d in deltas if d]) > 5 and "".join(deltas) == whole


def test_smollm2_structured_output_matches_the_schema(smollm2):
    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 30}, "capital": {"type": "string", "maxLength": 30}}}
    out = post(smollm2, "/v1/chat/completions", {
        "messages": ask("What is the capital of France? Answer in JSON."), "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}}})
    answer = json.loads(out["choices"][0]["message"]["content"])
    jsonschema.validate(answer, schema)
    assert answer["capital"] == "Paris"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_smollm2_calls_a_tool_with_valid_arguments(smollm2, tool_choice):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": WEATHER}}]
    out = post(smollm2, "/v1/chat/completions", {"messages": ask("What's the weather like in Paris?"), "tools": tools,
                                                 "tool_choice": tool_choice, "temperature": 0, "max_tokens": 60})
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "stop")
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER)
    assert args["city"] == "Paris"
