"""Adapter-aware routing (router/lora.py): a request under an adapter goes only to workers
that have it loaded, to those with it in a slot first (no swap), and spreads to the others
when the resident ones are busier by more than the slack; the body of the runtime
load/unload endpoints is checked in one line."""

from __future__ import annotations

import pytest

from splitserve.cluster.messages import LoadReport
from splitserve.router.errors import APIError
from splitserve.router.lora import lora_candidates, parse_lora_body


def report(worker: str, running: int = 0, loras=(), resident=()) -> LoadReport:
    return LoadReport(worker, "decode", 0, running, 0.1, loras={n: 7 for n in loras}, resident_loras=list(resident))


def test_only_workers_with_the_adapter_and_resident_first():
    loads = {"a": report("a", loras=["x"]), "b": report("b", loras=["x"], resident=["x"]), "c": report("c")}
    assert lora_candidates(["a", "b", "c"], [], loads, None) == ["a", "b", "c"]  # the base model: everyone
    assert lora_candidates(["a", "b", "c"], ["a", "b"], loads, "x") == ["b"]
    assert lora_candidates(["a", "c"], ["a"], loads, "x") == ["a"]  # loaded, not resident: only where loaded
    assert lora_candidates(["a", "b", "c"], [], loads, "unknown") == ["a", "b", "c"]  # none known to have it
    del loads["b"]  # b's report expired: it still has x (the router remembers), but is not known resident
    assert lora_candidates(["a", "b", "c"], ["a", "b"], loads, "x") == ["a", "b"]


def test_a_hot_adapter_spreads_past_the_slack():
    loads = {"a": report("a", running=2, loras=["x"]), "b": report("b", running=6, loras=["x"], resident=["x"])}
    assert lora_candidates(["a", "b"], ["a", "b"], loads, "x") == ["b"]  # 6 <= 2 + 4: stay where resident
    loads["b"] = report("b", running=7, loras=["x"], resident=["x"])
    assert lora_candidates(["a", "b"], ["a", "b"], loads, "x") == ["a", "b"]  # 7 > 2 + 4: either


@pytest.mark.parametrize("body,need_path,message", [
    (b"{}", True, "'lora_name' must be a non-empty string"),
    (b'{"lora_name": "x"}', True, "'lora_path' must be a non-empty string"),
    (b'{"lora_name": " "}', False, "'lora_name' must be a non-empty string"),
    (b"[1]", False, "the body must be a JSON object"),
    (b"{", False, "the body must be a JSON object"),
])
def test_bad_bodies_are_one_line_400s(body, need_path, message):
    with pytest.raises(APIError) as err:
        parse_lora_body(body, need_path)
    assert err.value.status == 400 and message in str(err.value) and "\n" not in str(err.value)


def test_good_bodies():
    assert parse_lora_body(b'{"lora_name": "x", "lora_path": "/a"}', True) == ("x", "/a")
    assert parse_lora_body(b'{"lora_name": "x"}', False) == ("x", "")
