"""JSON from clients and models is parsed only when nested no deeper than 128 levels
(core/bounded_json.py), so that no parse brings the stack to the interpreter's limit."""

from __future__ import annotations

import gc
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.core import bounded_json
from splitserve.core.bounded_json import MAX_DEPTH, NestedTooDeeply, deepest
from splitserve.router import json_body, tool_calls
from splitserve.router.errors import APIError
from splitserve.router.structured_fields import _guided
from splitserve.router.tools import arguments_for_template

DEEP_BODY = b'{"model": "m", "prompt": ' + b"[" * 10_000 + b"1" + b"]" * 10_000 + b"}"


def depth_of(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


tricky_text = st.text(st.sampled_from('[]{}"\\\\ aé\u2028\U0001f600'), max_size=8)
json_values = st.recursive(st.none() | st.integers() | tricky_text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
                           max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_the_depth_counts_brackets_outside_strings_only(value, ascii_only, indent):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert deepest(text) == deepest(text.encode()) == depth_of(value)


def test_128_levels_parse_and_129_are_refused_unparsed(monkeypatch):
    assert bounded_json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert bounded_json.loads('["' + "[" * 1000 + '"]') == ["[" * 1000]  # brackets in a string: depth 1
    parsed = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: parsed.append(a))
    with pytest.raises(NestedTooDeeply, match="^nested deeper than the 128 levels allowed$") as refused:
        bounded_json.loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert isinstance(refused.value, json.JSONDecodeError) and parsed == []


def test_a_deep_body_is_a_400_that_leaves_stack_for_what_runs_meanwhile():
    """Python's parser went ~1,000 levels deep before giving up; a garbage collection at that
    depth ran other objects' finalizers without the stack they need ("Exception ignored in ...",
    and their clean-up undone): the HTTP fuzz test failed that way once. A finalizer's needs are
    played by a gc callback that calls 20 frames deep, with a collection at every allocation."""

    def nest(n: int) -> int:
        return 0 if n == 0 else nest(n - 1)

    starved = []

    def finalizer_like(phase, info):
        try:
            nest(20)
        except RecursionError:
            starved.append(phase)

    threshold = gc.get_threshold()
    gc.callbacks.append(finalizer_like)
    gc.set_threshold(1)
    try:
        with pytest.raises(APIError) as refused:
            json_body.load(DEEP_BODY)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(finalizer_like)
    assert starved == []
    assert (refused.value.status, refused.value.code) == (400, "invalid_json")
    assert "nested deeper than the 128 levels allowed" in refused.value.message


def test_deep_json_inside_fields_and_model_output_is_refused_or_left_as_text():
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(APIError, match="'guided_json' is not valid JSON: nested deeper than"):
        _guided("guided_json", deep)
    assert arguments_for_template(deep) == deep  # an assistant message's arguments: kept as text
    # A model asked for tools that writes brackets 5,000 deep: no call, its text as content.
    for family, text in ((tool_calls.HERMES, f"<tool_call>{deep}</tool_call>"),
                         (tool_calls.LLAMA3, "{" + '"a":{' * 5000 + "}" * 5001)):
        assert tool_calls.parse(family, text) == (text, [])


def test_large_bodies_flat_and_deep():
    """Past one chunk of the running sum: a flat 6 MB conversation, and 16 MB of openers."""
    flat = json.dumps({"messages": [{"role": "user", "content": "x [y] \\\"z\\\""}] * 200_000})
    assert deepest(flat, stop_above=MAX_DEPTH) == 3
    assert deepest(b"[" * (16 << 20), stop_above=MAX_DEPTH) > MAX_DEPTH
