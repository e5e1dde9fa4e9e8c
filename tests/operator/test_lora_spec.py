"""spec.loras: the adapters reach both worker roles as the engine's LoRA flags (paths found
as the model's are), which the workers' own argument parser takes; bad entries are refused
with one problem each; the CRD knows the fields."""

from __future__ import annotations

import argparse
import copy

import pytest

from splitserve.engine.args import add_engine_args
from splitserve.engine.lora.args import parse_lora_modules
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import crd_schema, load_crd
from .test_kv_cache_dtype import worker_commands

LORAS = [{"name": "sql", "path": "adapters/sql"}, {"name": "chat-v2", "path": "/adapters/chat/"}]


def with_loras(spec: dict, loras, rank=None) -> dict:
    out = copy.deepcopy(spec)
    out["loras"] = loras
    if rank is not None:
        out.setdefault("engine", {})["maxLoraRank"] = rank
    return out


def test_both_roles_load_every_adapter_and_the_workers_parse_the_flags(minimal_spec):
    assert not any("--enable-lora" in c for c in worker_commands(parse_spec("x", "ns", minimal_spec, "img:1")).values())
    commands = worker_commands(parse_spec("x", "ns", with_loras(minimal_spec, LORAS, rank=32), "img:1"))
    for role in ("decode", "prefill"):
        words = commands[role].split(" ")
        ap = argparse.ArgumentParser()
        add_engine_args(ap)
        start = words.index("--enable-lora")
        args, _ = ap.parse_known_args(words[start:start + 7 + len(LORAS)])
        assert args.enable_lora and args.max_loras == 2 and args.max_lora_rank == 32, role
        assert parse_lora_modules(args.lora_modules) == {"sql": "/models/adapters/sql",
                                                         "chat-v2": "/models/adapters/chat"}, role


@pytest.mark.parametrize("loras, rank, message", [
    ([{"name": "a"}], None, r"spec.loras\[0\] needs a name and one of path or uri"),
    ([{"name": "a", "path": "x", "uri": "hf://o/a"}], None, r"spec.loras\[0\] needs a name and one of path or uri"),
    ([{"name": "a", "uri": "s3://bucket/a"}], None, r"spec.loras\[0\].uri: "),
    ([{"name": "a", "path": "x"}, {"name": "a", "path": "y"}], None, "'a' is listed twice"),
    ([{"name": "a", "path": "../etc"}], None, "without '..'"),
    ([{"name": "llama-3-8b", "path": "x"}], None, "not the served model name"),
    ([{"name": "a", "path": "x"}], 0, r"maxLoraRank must be an integer in \[1, 512\], got 0"),
    ("sql", None, "spec.loras must be a list"),
])
def test_bad_entries_are_refused(minimal_spec, loras, rank, message):
    with pytest.raises(SpecError, match=message):
        parse_spec("x", "ns", with_loras(minimal_spec, loras, rank), "img:1")


def test_a_downloaded_model_takes_downloaded_adapters_only(minimal_spec):
    spec = with_loras(minimal_spec, LORAS)
    spec["model"]["source"] = {"type": "uri", "uri": "hf://org/model"}
    with pytest.raises(SpecError, match=r"spec.loras\[0\].path: the model is downloaded"):
        parse_spec("x", "ns", spec, "img:1")
    spec["loras"] = [{"name": "sql", "uri": "hf://org/sql-lora@v2"}]
    assert parse_spec("x", "ns", spec, "img:1").loras.modules == (("sql", "/loras/sql"),)


def test_uri_adapters_are_fetched_by_init_containers_of_the_engine_pods(minimal_spec):
    from splitserve.operator.render import Replicas, render_all

    spec = with_loras(minimal_spec, [*LORAS, {"name": "hub", "uri": "hf://org/hub-lora"}])
    pods = {}
    for m in render_all(parse_spec("x", "ns", spec, "img:1"), Replicas(1, 1), "2.60.0"):
        if m["kind"] == "Deployment":
            pods[m["metadata"]["name"].rsplit("-", 1)[-1]] = m["spec"]["template"]["spec"]
        if m["kind"] == "RayCluster":
            pods["prefill"] = m["spec"]["headGroupSpec"]["template"]["spec"]
    for role in ("decode", "prefill"):
        fetch = [x for x in pods[role]["initContainers"] if x["name"].startswith("fetch-lora")]
        assert [x["args"] for x in fetch] == [["fetch-model", "hf://org/hub-lora", "/loras/hub"]], role
        assert {"name": "loras", "emptyDir": {}} in pods[role]["volumes"]
        assert {"name": "loras", "mountPath": "/loras", "readOnly": True} in pods[role]["containers"][0]["volumeMounts"]
        assert "hub=/loras/hub" in " ".join(pods[role]["containers"][0]["args"])
    assert not any(v["name"] == "loras" for v in pods["router"]["volumes"])  # the router loads no weights


def test_the_crd_knows_the_fields():
    spec = crd_schema(load_crd(), "v1alpha1")["properties"]["spec"]["properties"]
    assert spec["loras"]["items"]["required"] == ["name"]
    assert set(spec["loras"]["items"]["properties"]) == {"name", "path", "uri"}
    assert spec["engine"]["properties"]["maxLoraRank"]["default"] == 16
