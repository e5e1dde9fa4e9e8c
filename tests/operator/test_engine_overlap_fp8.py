"""spec.engine.asyncScheduling and spec.engine.fp8Activations: the decode workers get
--async-scheduling (prefill workers make one token: nothing to overlap), every worker
--fp8-activations when it is not auto; the CRD's CEL rules and the operator accept the
combinations the engine overlaps (refusals: test_compatibility_crd.py); the rendered flags
parse with the workers' own CLI."""

from __future__ import annotations

import pytest

from splitserve.engine.args import add_engine_args
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import crd_schema, load_crd
from .crd_values import admit
from .test_kv_cache_dtype import worker_commands

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def with_engine(spec: dict, **engine) -> dict:
    return {**spec, "engine": {**spec.get("engine", {}), **engine}}


def admitted(spec: dict) -> tuple[dict, list[str]]:
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": spec}
    return admit(crd_schema(load_crd(), "v1alpha1"), obj)


def test_defaults_add_no_flag(minimal_spec):
    stored, errors = admitted(minimal_spec)
    assert errors == [] and stored["spec"]["engine"]["asyncScheduling"] is False
    assert stored["spec"]["engine"]["fp8Activations"] == "auto"
    commands = worker_commands(parse_spec("x", "ns", stored["spec"], "img:1"))
    assert not any("--async-scheduling" in c or "--fp8-activations" in c for c in commands.values())


def test_the_flags_reach_their_workers_and_parse(minimal_spec):
    spec = with_engine(minimal_spec, asyncScheduling=True, fp8Activations="off")
    assert admitted(spec)[1] == []
    commands = worker_commands(parse_spec("x", "ns", spec, "img:1"))
    assert "--async-scheduling" in commands["decode"] and "--async-scheduling" not in commands["prefill"]
    assert all("--fp8-activations off" in c for c in commands.values())
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args, _ = parser.parse_known_args(["--async-scheduling", "--fp8-activations", "off"])
    assert args.async_scheduling is True and args.fp8_activations == "off"


@pytest.mark.parametrize("extra", [
    {"engine": {"asyncScheduling": True, "speculative": SPECULATIVE}},
    {"engine": {"asyncScheduling": True}, "loras": [{"name": "a", "path": "adapters/a"}]},
    {"engine": {"asyncScheduling": True}, "decode": {"tensorParallelSize": 2}},
    {"engine": {"asyncScheduling": True, "speculative": {"method": "draft_model", "model": "/d",
                                                         "num_speculative_tokens": 2}}},
], ids=["ngram", "lora", "tensor-parallel", "draft-model"])
def test_combinations_the_overlap_takes_are_accepted(minimal_spec, extra):
    """n-gram or draft-model speculation (a step that may draft is not overlapped), LoRA and
    tensor parallelism overlap (engine/overlap.py): accepted, the decode workers get the flag.
    How a refused pair is refused: tests/operator/test_compatibility_crd.py."""
    spec = {**minimal_spec, **extra}
    assert admitted(spec)[1] == []
    assert "--async-scheduling" in worker_commands(parse_spec("x", "ns", spec, "img:1"))["decode"]



def test_bad_values_are_refused(minimal_spec):
    _, errors = admitted(with_engine(minimal_spec, fp8Activations="yes"))
    assert errors
    with pytest.raises(SpecError, match="spec.engine.fp8Activations must be auto, on or off, got 'yes'"):
        parse_spec("x", "ns", with_engine(minimal_spec, fp8Activations="yes"), "img:1")
    with pytest.raises(SpecError, match="spec.engine.asyncScheduling must be true or false"):
        parse_spec("x", "ns", with_engine(minimal_spec, asyncScheduling="yes"), "img:1")
