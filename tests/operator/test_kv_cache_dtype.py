"""spec.engine.kvCacheDtype: the CRD's values are the engine's, the operator refuses others,
and both worker kinds (decode Deployment, prefill RayCluster) get the same --kv-cache-dtype."""

from __future__ import annotations

import pytest

from splitserve.engine.kv_cache import KV_CACHE_DTYPES
from splitserve.operator import spec as operator_spec
from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import crd_schema, load_crd


def worker_commands(spec) -> dict[str, str]:
    """Role -> its worker's command line, as one string."""
    out = {}
    for m in render_all(spec, Replicas(1, 1), "2.60.0"):
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-decode"):
            out["decode"] = " ".join(m["spec"]["template"]["spec"]["containers"][0]["args"])
        if m["kind"] == "RayCluster":
            out["prefill"] = " ".join(m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"])
    return out


def test_the_crd_and_the_operator_know_the_engines_values():
    field = crd_schema(load_crd(), "v1alpha1")["properties"]["spec"]["properties"]["engine"]["properties"]
    assert tuple(field["kvCacheDtype"]["enum"]) == KV_CACHE_DTYPES == operator_spec.KV_CACHE_DTYPES
    assert field["kvCacheDtype"]["default"] == "auto"


def test_fp8_reaches_both_worker_kinds_and_auto_adds_nothing(minimal_spec):
    plain = worker_commands(parse_spec("x", "ns", minimal_spec, "img:1"))
    assert set(plain) == {"decode", "prefill"} and not any("--kv-cache-dtype" in c for c in plain.values())
    fp8 = worker_commands(parse_spec("x", "ns", {**minimal_spec, "engine": {"kvCacheDtype": "fp8"}}, "img:1"))
    assert all("--kv-cache-dtype fp8" in c for c in fp8.values()), fp8


def test_an_unknown_kv_cache_dtype_is_refused(minimal_spec):
    with pytest.raises(SpecError, match="spec.engine.kvCacheDtype must be auto, fp8 or fp8_e4m3, got 'int8'"):
        parse_spec("x", "ns", {**minimal_spec, "engine": {"kvCacheDtype": "int8"}}, "img:1")
