"""spec.engine.speculative: vLLM's speculative-config object reaches the decode workers as
--speculative-config (prefill workers never speculate), the CRD knows the engine's methods,
and a config the engine would refuse is refused by the operator (a Degraded status), with
the real kopf handlers against the strict fake API server."""

from __future__ import annotations

import copy
import json

import pytest

from splitserve.core.speculative import METHODS, parse_speculative_config
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import crd_schema, load_crd
from .test_kopf_handlers import IFD, NS, child, condition, infd, wait_for
from .test_kv_cache_dtype import worker_commands

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
         "disable_by_batch_size": 16}


def with_speculative(spec: dict, speculative) -> dict:
    out = copy.deepcopy(spec)
    out.setdefault("engine", {})["speculative"] = speculative
    return out


def flag(command: str) -> dict:
    words = command.split(" ")
    return json.loads(words[words.index("--speculative-config") + 1])


def test_the_crd_knows_the_engine_s_methods_and_fields():
    field = crd_schema(load_crd(), "v1alpha1")["properties"]["spec"]["properties"]["engine"]["properties"]
    speculative = field["speculative"]
    assert tuple(speculative["properties"]["method"]["enum"]) == METHODS
    assert set(speculative["properties"]) == set(NGRAM) | {"model"}


def test_the_config_reaches_the_decode_workers_only(minimal_spec):
    plain = worker_commands(parse_spec("x", "ns", minimal_spec, "img:1"))
    assert not any("--speculative-config" in c for c in plain.values())
    commands = worker_commands(parse_spec("x", "ns", with_speculative(minimal_spec, NGRAM), "img:1"))
    assert flag(commands["decode"]) == NGRAM
    assert parse_speculative_config(flag(commands["decode"])).num_speculative_tokens == 5  # the engine takes it
    assert "--speculative-config" not in commands["prefill"]


@pytest.mark.parametrize("speculative, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer, got 0"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown method 'lookahead'"),
    ({"method": "eagle", "num_speculative_tokens": 2, "model": "/models/eagle"}, "method 'eagle' is not built yet"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'method draft_model needs "model"'),
    ("ngram", "spec.engine.speculative must be an object, got str"),
])
def test_a_config_the_engine_refuses_is_refused(minimal_spec, speculative, message):
    with pytest.raises(SpecError, match=message):
        parse_spec("x", "ns", with_speculative(minimal_spec, speculative), "img:1")


async def test_the_operator_passes_it_through_and_degrades_on_a_bad_one(cluster, minimal_spec):
    fake = cluster
    await fake.create(*IFD, NS, infd("spec", with_speculative(minimal_spec, NGRAM)))
    decode = await wait_for(lambda: child(fake, "Deployment", "spec-decode"), "decode Deployment")
    assert flag(" ".join(decode["spec"]["template"]["spec"]["containers"][0]["args"])) == NGRAM
    await fake.patch_spec(*IFD, NS, "spec", {"spec": {"engine": {"speculative": {"prompt_lookup_min": 4}}}})
    degraded = await wait_for(lambda: (condition(fake, "spec", "Degraded") or {}).get("status") == "True"
                              and condition(fake, "spec", "Degraded"), "Degraded condition")
    assert "spec.engine.speculative: prompt_lookup_min 4 is above prompt_lookup_max 3" in degraded["message"]
