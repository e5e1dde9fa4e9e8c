"""spec.engine.expertParallel: default false (no flag); on, --enable-expert-parallel reaches
the workers of the roles with tensorParallelSize > 1 only, and parses with the workers' own
CLI; with no such role it is refused in one line. Its pairs with other features:
test_compatibility_crd.py."""

from __future__ import annotations

import argparse

import pytest

from splitserve.engine.args import add_engine_args, flag_features
from splitserve.operator.spec import SpecError, parse_spec

from .test_engine_overlap_fp8 import admitted, with_engine
from .test_kv_cache_dtype import worker_commands


def test_default_is_off_and_adds_no_flag(minimal_spec):
    stored, errors = admitted({**minimal_spec, "decode": {"tensorParallelSize": 2}})
    assert errors == [] and stored["spec"]["engine"]["expertParallel"] is False
    parsed = parse_spec("x", "ns", stored["spec"], "img:1")
    assert parsed.expert_parallel is False
    assert not any("--enable-expert-parallel" in c for c in worker_commands(parsed).values())


def test_the_flag_reaches_the_tensor_parallel_role_only(minimal_spec):
    spec = {**with_engine(minimal_spec, expertParallel=True), "decode": {"tensorParallelSize": 2}}
    assert admitted(spec)[1] == []
    commands = worker_commands(parse_spec("x", "ns", spec, "img:1"))
    assert "--enable-expert-parallel" in commands["decode"] and "--enable-expert-parallel" not in commands["prefill"]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args, _ = parser.parse_known_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert flag_features(args) == {"tensor-parallel", "expert-parallel"}


def test_without_a_tensor_parallel_role_it_is_refused(minimal_spec):
    with pytest.raises(SpecError) as err:
        parse_spec("x", "ns", with_engine(minimal_spec, expertParallel=True), "img:1")
    assert err.value.problems == ["spec.engine.expertParallel spreads a MoE model's experts over a role's "
                                  "tensor-parallel ranks: set tensorParallelSize > 1 on prefill or decode"]
    with pytest.raises(SpecError, match="spec.engine.expertParallel must be true or false"):
        parse_spec("x", "ns", {**with_engine(minimal_spec, expertParallel="yes"), "decode": {"tensorParallelSize": 2}},
                   "img:1")
