"""The compatibility table (core/compatibility.py) on InferenceDeployments: every pair of
features a spec can ask for, walked through the CRD's CEL rules (cel-python, as the API
server and tests/operator/fake_kube.py evaluate them) and the operator's parse_spec: a
refused pair is refused by both with the table's one line, every other pair is accepted and
renders workers whose own flag check (engine/args.py compatibility_problem) accepts their
flags and sees the same features. The CRD's generated rules are exactly the generator's."""

from __future__ import annotations

import argparse
import shlex

import pytest
import yaml

from splitserve.core.compatibility import PAIRS, all_pairs, message, refused, verdict
from splitserve.engine.args import add_engine_args, compatibility_problem, flag_features
from splitserve.operator import spec_compatibility
from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import CRD_PATH, crd_schema, load_crd
from .crd_values import admit
from .fake_kube import ApiError, FakeKube
from .fake_lifecycle import CRDS

LORAS = [{"name": "a", "path": "adapters/a"}]


def spec_part(feature: str, role: str) -> dict | None:
    """The spec fields turning `feature` on for `role`'s workers; None: no field does."""
    engine = {"async-scheduling": {"asyncScheduling": True},
              "ngram": {"speculative": {"method": "ngram", "num_speculative_tokens": 2}},
              "draft-model": {"speculative": {"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}},
              "mtp": {"speculative": {"method": "mtp", "num_speculative_tokens": 2}},
              "fp8-kv-cache": {"kvCacheDtype": "fp8"}}
    if feature in engine:
        return {"engine": engine[feature]}
    if feature == "expert-parallel":  # on the roles with tensor parallelism
        return {"engine": {"expertParallel": True}, role: {"tensorParallelSize": 2}}
    return {"tensor-parallel": {role: {"tensorParallelSize": 2}},
            "lora": {"loras": LORAS},
            "kv-offload-host": {role: {"kvOffload": {"hostGiB": 1}}},
            "kv-offload-disk": {role: {"kvOffload": {"disk": {"sizeGiB": 1}}}},
            "mooncake": {"kvTransfer": {"backend": "mooncake"}}}.get(feature)


def merged(base: dict, *parts: dict) -> dict | None:
    """base with the parts merged in (deeply); None when two parts set one field differently."""
    def merge(into: dict, part: dict) -> bool:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(into.get(key, {}), dict):
                into[key] = dict(into.get(key, {}))
                if not merge(into[key], value):
                    return False
            elif key in into and into[key] != value:
                return False
            else:
                into[key] = value
        return True

    out = dict(base)
    return out if all(merge(out, part) for part in parts) else None


def admitted_errors(schema: dict, spec: dict) -> list[str]:
    """The API server's errors for the object on create (fake_kube.py's admission)."""
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": spec}
    return admit(schema, obj)[1]


def worker_args(spec) -> dict[str, list[str]]:
    """Role -> its rendered worker's arguments."""
    out = {}
    for m in render_all(spec, Replicas(1, 1), "2.60.0"):
        if m["kind"] == "Deployment" and m["metadata"]["name"].endswith("-decode"):
            out["decode"] = m["spec"]["template"]["spec"]["containers"][0]["args"][1:]
        if m["kind"] == "RayCluster":
            script = m["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["args"][0]
            out["prefill"] = shlex.split(script.split("exec splitserve prefill-pool", 1)[1])
    return out


def parse_flags(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--kv-backend", default="grpc")
    return ap.parse_known_args(argv)[0]


PER_ROLE = {"tensor-parallel", "expert-parallel", "kv-offload-host", "kv-offload-disk"}  # each role's own fields


def cases() -> list[tuple[str, str, str]]:
    """(a, b, role): a pair with its per-role features on prefill, then on decode; a pair of
    deployment-wide features once."""
    return [(a, b, role) for a, b in all_pairs() for role in ("prefill", "decode")
            if role == "decode" or PER_ROLE & {a, b}]


@pytest.fixture(scope="module")
def schema():
    return crd_schema(load_crd(), "v1alpha1")


@pytest.mark.parametrize("a, b, role", cases(), ids=[f"{a}+{b}@{r}" for a, b, r in cases()])
def test_the_crd_and_the_operator_refuse_exactly_the_refused_pairs(schema, minimal_spec, a, b, role):
    pa, pb = spec_part(a, role), spec_part(b, role)
    if pa is None or pb is None:
        pytest.skip("no spec field turns it on (CUDA graphs cannot be forced; quantization is the checkpoint's)")
    spec = merged(minimal_spec, pa, pb)
    if spec is None:  # one field, one value (the speculative method)
        assert not verdict(a, b).works and (a, b) in spec_compatibility.ONE_FIELD
        return
    decode_only = {"async-scheduling", "ngram", "draft-model", "mtp"}
    # on the prefill role, a decode-only feature does not meet a per-role one there
    meets = role == "decode" or not ({a, b} & decode_only)
    errors = admitted_errors(schema, spec)
    if verdict(a, b).works or not meets:
        assert errors == []
        parsed = parse_spec("x", "ns", spec, "img:1")
        for name, argv in worker_args(parsed).items():  # what the workers will say of their flags
            args = parse_flags(argv)
            assert compatibility_problem(args) is None, (name, argv)
            features = {a, b} - (decode_only if name == "prefill" else set())
            if "expert-parallel" in features:  # it runs over tensor-parallel ranks
                features.add("tensor-parallel")
            if name != role:
                features -= PER_ROLE
            assert flag_features(args) == features, (name, argv)
        return
    line = message(a, b)
    assert len(errors) == 1 and errors[0].endswith(line), errors
    with pytest.raises(SpecError) as err:
        parse_spec("x", "ns", spec, "img:1")
    assert err.value.problems == [line]


def test_a_pair_split_over_the_roles_is_accepted(schema, minimal_spec):
    """Tensor parallelism on prefill and async scheduling (decode workers only): no worker runs both."""
    spec = merged(minimal_spec, spec_part("tensor-parallel", "prefill"), spec_part("async-scheduling", "decode"))
    assert admitted_errors(schema, spec) == []
    assert parse_spec("x", "ns", spec, "img:1").prefill.tensor_parallel_size == 2


MARKED = [("tensor-parallel", "draft-model"), ("async-scheduling", "draft-model")]


def marked_crd(monkeypatch) -> dict:
    """Every pair a spec can ask for works today (n-gram x draft model is one field), so the
    refusal paths run on a table with MARKED marked refused, and a CRD whose rules were
    generated from it (what `spec_compatibility --write` would write)."""
    for pair in MARKED:
        monkeypatch.setitem(PAIRS, pair, refused("marked refused by this test"))
    text = CRD_PATH.read_text()
    return yaml.safe_load(text.replace(spec_compatibility.crd_block(text), spec_compatibility.crd_rules_yaml()))


def test_every_refused_pair_of_a_spec_is_listed_once(schema, minimal_spec, monkeypatch):
    spec = merged(minimal_spec, spec_part("tensor-parallel", "prefill"), spec_part("mooncake", "prefill"),
                  spec_part("tensor-parallel", "decode"), spec_part("draft-model", "decode"),
                  spec_part("async-scheduling", "decode"))
    assert parse_spec("x", "ns", spec, "img:1") and admitted_errors(schema, spec) == []  # the table as it is
    crd = marked_crd(monkeypatch)
    want = [message(*pair) for pair in MARKED]  # decode's (TP x Mooncake, on both roles, works)
    with pytest.raises(SpecError) as err:
        parse_spec("x", "ns", spec, "img:1")
    assert err.value.problems == want
    errors = admitted_errors(crd_schema(crd, "v1alpha1"), spec)
    assert len(errors) == 2 and all(any(e.endswith(line) for e in errors) for line in want), errors


def test_the_crds_rules_are_the_generated_ones():
    """`python -m splitserve.operator.spec_compatibility --write` wrote them (re-run it after
    a flip in core/compatibility.py)."""
    text = CRD_PATH.read_text()
    assert spec_compatibility.crd_block(text) == spec_compatibility.crd_rules_yaml()
    rules = crd_schema(load_crd())["properties"]["spec"]["x-kubernetes-validations"]
    generated = spec_compatibility.crd_rules()
    assert [r for r in rules if r["message"] in {g["message"] for g in generated}] == generated
    assert not any("cannot be combined" in r["message"] for r in rules if r not in generated)


async def test_the_fake_api_server_refuses_the_issues_example(minimal_spec, monkeypatch):
    """issue 50's kind of example, a draft model with `tensorParallelSize: 2`, used to pass
    the operator and crash-loop its workers; it works now and is accepted at create, as is
    `kvOffload` with `tensorParallelSize: 2`. A refused pair is refused at create in the
    table's words: the same example under a CRD generated from a table marking it refused."""
    spec = merged(minimal_spec, spec_part("draft-model", "decode"), spec_part("tensor-parallel", "decode"))
    ifd = ("splitserve.io/v1alpha1", "inferencedeployments")
    body = {"apiVersion": ifd[0], "kind": "InferenceDeployment", "metadata": {"name": "x"}, "spec": spec}
    for crd, refusing in ((load_crd(), False), (marked_crd(monkeypatch), True)):
        fake = FakeKube({})
        await fake.start()
        try:
            await fake.create(*CRDS, None, crd)
            await fake.create_namespace("ns")
            if refusing:
                with pytest.raises(ApiError) as err:
                    await fake.create(*ifd, "ns", body)
                assert err.value.code == 422
                assert err.value.message == ('InferenceDeployment.splitserve.io "x" is invalid: spec: Invalid '
                                             f'value: "object": {message("tensor-parallel", "draft-model")}')
                continue
            assert (await fake.create(*ifd, "ns", body))["spec"]["engine"]["speculative"]["method"] == "draft_model"
            spec = merged(minimal_spec, spec_part("kv-offload-disk", "decode"), spec_part("tensor-parallel", "decode"))
            offload = {**body, "metadata": {"name": "offload"}, "spec": spec}
            assert (await fake.create(*ifd, "ns", offload))["spec"]["decode"]["tensorParallelSize"] == 2
            spec = merged(minimal_spec, spec_part("mooncake", "decode"), spec_part("tensor-parallel", "prefill"))
            mooncake = {**body, "metadata": {"name": "mooncake"}, "spec": spec}  # a Mooncake segment per rank
            assert (await fake.create(*ifd, "ns", mooncake))["spec"]["prefill"]["tensorParallelSize"] == 2
            spec = merged(minimal_spec, spec_part("lora", "decode"), spec_part("tensor-parallel", "decode"),
                          spec_part("ngram", "decode"))
            lora = {**body, "metadata": {"name": "lora"}, "spec": spec}
            assert (await fake.create(*ifd, "ns", lora))["spec"]["decode"]["tensorParallelSize"] == 2
        finally:
            await fake.stop()
