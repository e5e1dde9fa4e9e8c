"""The InferenceDeployment CRD passes what kube-apiserver checks at CRD creation
(crd_rules.py), every `default:` satisfies its node's schema and CEL rules, and the
fake API server refuses a CRD that breaks them, with the real server's message."""

from __future__ import annotations

import copy

import aiohttp
import pytest

from .conftest import crd_schema, load_crd
from .crd_rules import crd_errors, rejection
from .crd_values import apply_defaults, openapi_errors, rule_errors
from .fake_kube import ApiError, FakeKube
from .fake_lifecycle import CRDS

SCHEMA_PATH = "spec.versions[0].schema.openAPIV3Schema"
SOURCE = f"{SCHEMA_PATH}.properties[spec].properties[model].properties[source]"
ROUTER = f"{SCHEMA_PATH}.properties[spec].properties[router]"


def defaults(node: dict, path: str = SCHEMA_PATH):
    """(path, node) of every schema node with a `default:`."""
    if "default" in node:
        yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from defaults(sub, f"{path}.properties[{name}]")
    if isinstance(node.get("items"), dict):
        yield from defaults(node["items"], f"{path}.items")


def test_the_crd_passes_every_api_server_check():
    assert crd_errors(load_crd()) == []


def test_every_default_satisfies_its_schema_and_every_rule():
    """As written (what kube-apiserver validates) and after nested defaulting (what an
    object omitting the field gets), against the node's schema and every CEL rule at
    or below the node."""
    found = list(defaults(crd_schema(load_crd())))
    assert len(found) > 30
    nodes_with_rules = 0
    for path, node in found:
        for value in (copy.deepcopy(node["default"]), apply_defaults(node, copy.deepcopy(node["default"]))):
            assert openapi_errors(node, value, path) == []
            assert rule_errors(node, value, path) == []
        nodes_with_rules += bool(node.get("x-kubernetes-validations"))
    assert nodes_with_rules >= 3  # prefill, decode, autoscaling: the defaults that carry rules


def test_spelled_out_defaults_agree_with_their_fields_defaults():
    """A default written out in full (needed where CEL rules read its fields) must
    say what the fields' own defaults say."""
    for path, node in defaults(crd_schema(load_crd())):
        if isinstance(node["default"], dict):
            for name, value in node["default"].items():
                own = (node.get("properties") or {}).get(name, {}).get("default")
                assert own is None or own == value, f"{path}.default.{name} is {value}, its own default {own}"


def broken(edit) -> dict:
    crd = load_crd()
    edit(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    return crd


def spec_props(schema: dict) -> dict:
    return schema["properties"]["spec"]["properties"]


SHIPPED_SOURCE_RULES = [  # spec.model.source's rules in the CRD that shipped with the bug
    {"rule": "self.type != 'pvc' || (has(self.claimName) && self.claimName != '')",
     "message": "source.claimName is required when source.type is pvc"},
    {"rule": "self.type != 'hostPath' || (has(self.hostPath) && self.hostPath.startsWith('/'))",
     "message": "source.hostPath must be an absolute node path when source.type is hostPath"}]


def source_default_empty(schema):  # the bug the CRD shipped with
    model = spec_props(schema)["model"]
    model["required"].remove("source")
    model["properties"]["source"].update({"default": {}, "x-kubernetes-validations": SHIPPED_SOURCE_RULES})


def source_rule_guarded(schema):  # passes as written, fails once type is defaulted
    source = spec_props(schema)["model"]["properties"]["source"]
    source["default"] = {}
    source["x-kubernetes-validations"] = [{"rule": "!has(self.type) || self.type != 'pvc' || has(self.claimName)",
                                           "message": "source.claimName is required when source.type is pvc"}]


NO_SUCH_KEY = [f'{SOURCE}.default: Invalid value: "object": no such key: type evaluating rule: {r["rule"]}'
               for r in SHIPPED_SOURCE_RULES]

BROKEN = [
    ("default {} under a rule reading a defaulted field", source_default_empty, NO_SUCH_KEY),
    ("default failing a rule only after nested defaulting", source_rule_guarded,
     [f"{SOURCE}.default: Invalid value: \"object\": source.claimName is required when source.type is pvc "
      '(after nested defaulting: {"type": "pvc"})']),
    ("default failing its own rule", lambda s: spec_props(s)["prefill"].update(
        default={"replicas": 9, "minReplicas": 1, "maxReplicas": 4}),
     [f"{SCHEMA_PATH}.properties[spec].properties[prefill].default: Invalid value: \"object\": "
      "replicas must lie within [minReplicas, maxReplicas]"]),
    ("default of the wrong type", lambda s: spec_props(s)["router"]["properties"]["replicas"].update(default="2"),
     [f'{ROUTER}.properties[replicas].default: Invalid value: "2": '
      f'{ROUTER}.properties[replicas].default in body must be of type integer: "string"']),
    ("null default on a non-nullable field", lambda s: spec_props(s)["router"].update(default=None),
     [f'{SCHEMA_PATH}.properties[spec].properties[router].default: Invalid value: null: '
      f'{SCHEMA_PATH}.properties[spec].properties[router].default in body must be of type object: "null"']),
    ("default with an unknown field", lambda s: spec_props(s)["redis"].update(default={"host": "redis"}),
     [f'{SCHEMA_PATH}.properties[spec].properties[redis].default: Invalid value: "object": '
      "must not have unknown fields"]),
    ("node without a type", lambda s: spec_props(s)["router"].pop("type"),
     [f"{SCHEMA_PATH}.properties[spec].properties[router].type: Required value: "
      "must not be empty for specified object fields"]),
    ("type inside anyOf", lambda s: spec_props(s)["blockSize"].update(anyOf=[{"type": "integer", "minimum": 1}]),
     [f"{SCHEMA_PATH}.properties[spec].properties[blockSize].anyOf[0].type: Forbidden: "
      "must be empty to be structural"]),
    ("description inside allOf", lambda s: spec_props(s)["blockSize"].update(allOf=[{"description": "x"}]),
     [f"{SCHEMA_PATH}.properties[spec].properties[blockSize].allOf[0].description: Forbidden: "
      "must be empty to be structural"]),
    ("array without items", lambda s: spec_props(s).update(extra={"type": "array"}),
     [f"{SCHEMA_PATH}.properties[spec].properties[extra].items: Required value: must be specified"]),
    ("list-type on an object", lambda s: spec_props(s)["redis"].update({"x-kubernetes-list-type": "atomic"}),
     [f'{SCHEMA_PATH}.properties[spec].properties[redis].x-kubernetes-list-type: Invalid value: "atomic": '
      "must only be used if type is array"]),
    ("preserve-unknown-fields false", lambda s: spec_props(s)["redis"].update(
        {"x-kubernetes-preserve-unknown-fields": False}),
     [f"{SCHEMA_PATH}.properties[spec].properties[redis].x-kubernetes-preserve-unknown-fields: Invalid value: "
      "false: must be true or undefined"]),
    ("root metadata beyond name", lambda s: s["properties"].update(
        metadata={"type": "object", "properties": {"labels": {"type": "object"}}}),
     [f"{SCHEMA_PATH}.properties[metadata]: Forbidden: must not specify anything other than name and "
      "generateName, but metadata is implicitly specified"]),
    ("kind not a string", lambda s: s["properties"].update(kind={"type": "integer"}),
     [f'{SCHEMA_PATH}.properties[kind].type: Invalid value: "integer": must be string']),
    ("embedded resource without object metadata", lambda s: spec_props(s).update(template={
        "type": "object", "x-kubernetes-embedded-resource": True,
        "properties": {"metadata": {"type": "string"}}}),
     [f'{SCHEMA_PATH}.properties[spec].properties[template].properties[metadata].type: Invalid value: "string": '
      "must be object"]),
    ("properties and additionalProperties", lambda s: spec_props(s)["redis"].update(
        additionalProperties={"type": "string"}),
     [f"{SCHEMA_PATH}.properties[spec].properties[redis].additionalProperties: Forbidden: "
      "additionalProperties and properties are mutual exclusive"]),
    ("a rule that does not compile", lambda s: spec_props(s)["kvTransfer"].update(
        {"x-kubernetes-validations": [{"rule": "self.backend ==", "message": "m"}]}),
     [f'{SCHEMA_PATH}.properties[spec].properties[kvTransfer].x-kubernetes-validations[0].rule: Invalid value: '
      '"self.backend ==": compilation failed: ERROR: <input>:1:14: Syntax error']),
    ("a rule naming no field of its node", lambda s: spec_props(s)["kvTransfer"].update(
        {"x-kubernetes-validations": [{"rule": "self.backnd == 'grpc'", "message": "m"}]}),
     [f"{SCHEMA_PATH}.properties[spec].properties[kvTransfer].x-kubernetes-validations[0].rule: Invalid value: "
      "\"self.backnd == 'grpc'\": compilation failed: ERROR: undefined field 'backnd'"]),
]


@pytest.mark.parametrize("what,edit,errors", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_copies_are_rejected(what, edit, errors):
    assert crd_errors(broken(edit)) == errors


async def test_the_fake_api_server_refuses_a_broken_crd_and_serves_a_good_one(minimal_spec):
    fake = FakeKube({})
    await fake.start()
    try:
        bad = broken(source_default_empty)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{fake.url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                 json=bad) as resp:
                assert resp.status == 422
                status = await resp.json()
        assert status["reason"] == "Invalid"
        assert status["message"] == (
            'CustomResourceDefinition.apiextensions.k8s.io "inferencedeployments.splitserve.io" is invalid: '
            f"[{', '.join(NO_SUCH_KEY)}]")
        assert status["message"] == rejection(bad, crd_errors(bad))
        assert fake.get(*CRDS, None, "inferencedeployments.splitserve.io") is None

        await fake.create(*CRDS, None, load_crd())
        await fake.create_namespace("ns")
        ifd = ("splitserve.io/v1alpha1", "inferencedeployments")
        body = {"apiVersion": ifd[0], "kind": "InferenceDeployment", "metadata": {"name": "x"}, "spec": minimal_spec}
        stored = await fake.create(*ifd, "ns", {**body, "spec": {**minimal_spec, "unknownField": 1}})
        assert "unknownField" not in stored["spec"]  # pruned
        assert stored["spec"]["prefill"] == {"replicas": 1, "minReplicas": 1, "maxReplicas": 4,
                                             "maxNumBatchedTokens": 8192, "maxNumSeqs": 256}  # defaulted
        bad_spec = copy.deepcopy(minimal_spec)
        bad_spec["model"]["source"] = {"type": "pvc"}
        with pytest.raises(ApiError) as err:
            await fake.create(*ifd, "ns", {**body, "metadata": {"name": "y"}, "spec": bad_spec})
        assert err.value.code == 422
        assert err.value.message == ('InferenceDeployment.splitserve.io "y" is invalid: spec.model.source: '
                                     'Invalid value: "object": source.claimName is required when source.type is pvc')
    finally:
        await fake.stop()
