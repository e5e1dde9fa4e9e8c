"""Fuzzing the HTTP API of a real stack (router app + decode and prefill workers over
mTLS): schemathesis generates requests from /openapi.json (valid and invalid ones),
hypothesis generates parameter values and token sequences of every type. Over 10,000
requests in all: no 5xx, no crash, every answer well formed and conforming to the
document, and every KV block free at the end."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    status_code_conformance,
)
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.security.conftest import MAX_MODEL_LEN, SERVED

COUNTS: dict[str, int] = {}
# (path, generation mode, examples): parameterless GETs have no invalid inputs to generate
OPERATIONS = [(path, mode, n) for path in ("/v1/completions", "/v1/chat/completions")
              for mode, n in ((GenerationMode.POSITIVE, 300), (GenerationMode.NEGATIVE, 500))] + [
    (path, GenerationMode.POSITIVE, 20) for path in ("/v1/models", "/health", "/metrics", "/openapi.json")] + [
    (path, mode, 200) for path in ("/tokenize", "/detokenize")
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)] + [
    ("/v1/models/{model_id}", GenerationMode.POSITIVE, 50)]
HYPOTHESIS_EXAMPLES = 2600  # per parameter family below (with schemathesis ~11,400 requests)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
FUZZ_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def session(stack):
    with requests.Session() as s:
        s.headers.update(stack.auth)
        yield s


@pytest.fixture(scope="module")
def api(stack):
    doc = requests.get(stack.base_url + "/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(doc)


def count(kind: str) -> None:
    COUNTS[kind] = COUNTS.get(kind, 0) + 1


@pytest.mark.parametrize("path, mode, examples", OPERATIONS, ids=[f"{p}-{m.value}" for p, m, _ in OPERATIONS])
def test_schemathesis_from_the_openapi_document(stack, api, session, path, mode, examples):
    operation = next(r.ok() for r in api.get_all_operations() if r.ok().path == path)

    @settings(max_examples=examples, **FUZZ_SETTINGS)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(base_url=stack.base_url, session=session, timeout=60)
        count("schemathesis")
        case.validate_response(response, checks=CHECKS)

    fuzz()
    stack.wait_all_blocks_free()


# ---- hypothesis: values of every JSON type in every parameter --------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                           | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(0, 600), st.integers(-5, 2**70), st.floats(), st.booleans(),
                               st.text(max_size=3)), max_size=MAX_MODEL_LEN + 8)
PARAMS = ["max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
          "logprobs", "ignore_eos", "stream", "stream_options", "echo", "best_of", "logit_bias", "user",
          "skip_special_tokens", "response_format", "max_completion_tokens", "top_logprobs", "tools"]
small_numbers = st.one_of(st.integers(-3, 6), st.floats(-1, 3, allow_nan=False), st.sampled_from([2**31, 2**63, -2**63]))
param_values = st.dictionaries(st.sampled_from(PARAMS), st.one_of(small_numbers, json_values), max_size=5)


def _post_and_check(stack, session, path: str, body) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = session.post(stack.base_url + path, data=data, headers={"Content-Type": "application/json"}, timeout=60)
    count("hypothesis")
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text
    elif r.headers["Content-Type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
    else:
        assert r.json()["choices"], r.text


@settings(max_examples=HYPOTHESIS_EXAMPLES, **FUZZ_SETTINGS)
@given(prompt=st.one_of(token_ids, st.text(max_size=200), json_values), params=param_values)
def test_hypothesis_completions(stack, session, prompt, params):
    body = {"model": SERVED, "prompt": prompt, "max_tokens": 2, **params}
    _post_and_check(stack, session, "/v1/completions", body)


roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", None, 3])
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={
    "content": st.one_of(st.text(max_size=60), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", 1])}, optional={"text": st.one_of(st.text(max_size=20),
                                                                                          json_values)})), json_values),
    "name": st.one_of(st.text(max_size=5), json_values)}), max_size=4)


@settings(max_examples=HYPOTHESIS_EXAMPLES, **FUZZ_SETTINGS)
@given(msgs=st.one_of(messages, json_values), params=param_values)
def test_hypothesis_chat(stack, session, msgs, params):
    body = {"model": SERVED, "messages": msgs, "max_tokens": 2, **params}
    _post_and_check(stack, session, "/v1/chat/completions", body)


@settings(max_examples=HYPOTHESIS_EXAMPLES // 2, **FUZZ_SETTINGS)
@given(raw=st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hypothesis_raw_bodies(stack, session, raw, path):
    _post_and_check(stack, session, path, raw)


# ---- hostile values: unpaired surrogates, numbers beyond float32/int64, deep nesting -----------
surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # st.text() never draws these
hostile_text = st.text(st.one_of(st.characters(), surrogate), max_size=30)
huge_number = st.one_of(st.integers(10**18, 10**400), st.integers(-10**400, -10**18),
                        st.floats(min_value=3.5e38, allow_infinity=False), st.floats(max_value=-3.5e38,
                                                                                  allow_infinity=False))
hostile_value = st.one_of(hostile_text, huge_number, st.lists(st.one_of(hostile_text, huge_number), max_size=3))
FIELDS = PARAMS + ["prompt", "model", "user", "x-unknown"]


@settings(max_examples=HYPOTHESIS_EXAMPLES // 3, **FUZZ_SETTINGS)
@given(field=st.sampled_from(FIELDS), value=hostile_value, content=hostile_text,
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hypothesis_hostile_values(stack, session, field, value, content, path):
    base = ({"prompt": content} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": content}]})
    body = {"model": SERVED, "max_tokens": 2, **base, field: value}
    _post_and_check(stack, session, path, body)


@settings(max_examples=HYPOTHESIS_EXAMPLES // 6, **FUZZ_SETTINGS)
@given(depth=st.integers(1, 20_000), where=st.sampled_from(["prompt", "stop", "messages", "logit_bias", "x"]),
       opener=st.sampled_from(["[", '{"a":']), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hypothesis_deep_nesting(stack, session, depth, where, opener, path):
    closer = "]" if opener == "[" else "}"
    nested = opener * depth + "1" + closer * depth
    base = '"prompt": "hi"' if path == "/v1/completions" else '"messages": [{"role": "user", "content": "hi"}]'
    raw = f'{{"model": "{SERVED}", "max_tokens": 2, {base}, "{where}": {nested}}}'.encode()
    _post_and_check(stack, session, path, raw)


def test_total_requests_and_blocks(stack):
    """Runs last in this file: the sum over the tests above, and the stack's KV blocks."""
    total = sum(COUNTS.values())
    print(f"fuzzing: {COUNTS} = {total} requests")
    assert total >= 10_000, COUNTS
    stack.wait_all_blocks_free()
    assert requests.get(stack.base_url + "/health", timeout=10).json()["admission"]["in_flight"] == 0
