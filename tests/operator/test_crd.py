"""The InferenceDeployment CRD: structural schema, defaults, CEL rules, printer
columns; example manifests accepted, invalid ones rejected.

jsonschema checks the OpenAPI part; the CEL rules are evaluated with cel-python
(crd_values.py), and the operator's parse_spec must reject the same specs (it repeats
the CEL rules; see splitserve/operator/spec.py). What the API server checks when the
CRD is created (structural schema, defaults) is in test_crd_rules.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from splitserve.operator.spec import SpecError, parse_spec

from .conftest import REPO, checked_validator, crd_schema, load_crd
from .crd_values import apply_defaults, rule_errors

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def cel_failures(schema: dict, obj: dict) -> list[str]:
    """Every CEL rule failure on obj (the rule's message, in the API server's words)."""
    return rule_errors(schema, obj, "")


@pytest.fixture(scope="module")
def schema() -> dict:
    return crd_schema(load_crd(), "v1alpha1")


@pytest.fixture(scope="module")
def validate(schema):
    """jsonschema.validate(instance, schema), the CRD schema checked once for the module."""
    return checked_validator(schema)


def test_crd_names_status_and_printer_columns():
    crd = load_crd()
    assert crd["metadata"]["name"] == "inferencedeployments.splitserve.io"
    assert crd["spec"]["names"]["shortNames"] == ["infd"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Ready": '.status.conditions[?(@.type=="Ready")].status',
                       "Prefill": ".status.prefillReplicas", "Decode": ".status.decodeReplicas",
                       "Queue": ".status.queue", "Model": ".spec.model.servedName",
                       "Age": ".metadata.creationTimestamp"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(schema, validate, path: Path):
    obj = yaml.safe_load(path.read_text())
    validate(obj)
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    validate(defaulted)
    assert cel_failures(schema, defaulted) == []
    parse_spec(obj["metadata"]["name"], obj["metadata"]["namespace"], obj["spec"], "img:1")


def test_crd_defaults_match_the_operator_defaults(schema, minimal_spec):
    """The operator parses a spec the API server did not default (old objects, tests)
    exactly like one it did."""
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": minimal_spec}
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    assert defaulted["spec"]["decode"]["drainTimeoutSeconds"] == 600  # defaults did apply, nested
    assert defaulted["spec"]["decode"]["prefillTimeoutSeconds"] == 30
    assert parse_spec("x", "ns", defaulted["spec"], "img:1") == parse_spec("x", "ns", minimal_spec, "img:1")


# (what, patch applied to the minimal spec, text the schema error or the CEL message
# contains, text parse_spec's error contains)
INVALID_BY_SCHEMA = [
    ("no model path", {"model": {"path": None}}, "'path' is a required property", "spec.model.path is required"),
    ("unknown kv backend", {"kvTransfer": {"backend": "nccl"}}, "'nccl' is not one of", "backend must be grpc or mooncake"),
    ("zero replicas", {"decode": {"replicas": 0}}, "0 is less than the minimum of 1", "spec.decode.replicas must be >= 1"),
    ("zero tensor parallel", {"decode": {"tensorParallelSize": 0}}, "0 is less than the minimum of 1",
     "spec.decode.tensorParallelSize must be >= 1"),
    ("block size not a power of two", {"blockSize": 12}, "12 is not one of", "power of two"),
    ("redis url scheme", {"redis": {"url": "http://redis:6379"}}, "does not match", "must start with redis://"),
    ("source type", {"model": {"source": {"type": "s3"}}}, "'s3' is not one of", "pvc, hostPath, image or uri"),
    ("replicas as string", {"router": {"replicas": "two"}}, "'two' is not of type 'integer'", "must be an integer"),
    ("negative kv cache", {"decode": {"kvCacheMemoryGiB": -1}}, "-1 is less than the minimum of 0", "kvCacheMemoryGiB must be > 0"),
    ("unknown dtype", {"model": {"dtype": "int4"}}, "'int4' is not one of", "dtype must be bfloat16, float16 or float32"),
    ("zero stream interval", {"router": {"streamInterval": 0}}, "0 is less than the minimum of 1",
     "spec.router.streamInterval must be >= 1"),
    ("strict as a string", {"router": {"strictDisaggregation": "yes"}}, "'yes' is not of type 'boolean'",
     "spec.router.strictDisaggregation must be true or false"),
    ("sub-second prefill timeout", {"decode": {"prefillTimeoutSeconds": 0.5}}, "0.5 is less than the minimum of 1",
     "spec.decode.prefillTimeoutSeconds must be in [1, 600], got 0.5"),
    ("prefill timeout past a push's limit", {"decode": {"prefillTimeoutSeconds": 900}},
     "900 is greater than the maximum of 600", "spec.decode.prefillTimeoutSeconds must be in [1, 600], got 900"),
    ("prefill at zero", {"prefill": {"minReplicas": 0}}, "0 is less than the minimum of 1",
     "spec.prefill.minReplicas must be >= 1"),
    ("no held requests", {"autoscaling": {"holdRequestsAtZero": 0}}, "0 is less than the minimum of 1",
     "spec.autoscaling.holdRequestsAtZero must be >= 1"),
    ("tls issuer kind", {"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "Vault"}}}},
     "'Vault' is not one of", "issuerRef.kind must be Issuer or ClusterIssuer, got 'Vault'"),
    ("tls without issuer", {"tls": {"certManager": {}}}, "'issuerRef' is a required property",
     "spec.tls.certManager.issuerRef.name is required"),
]
INVALID_BY_CEL = [
    ("min > max", {"decode": {"minReplicas": 5, "maxReplicas": 2, "replicas": 2}},
     "minReplicas must be <= maxReplicas", "spec.decode.minReplicas (5) must be <= spec.decode.maxReplicas (2)"),
    ("replicas above max", {"prefill": {"replicas": 9, "maxReplicas": 4}},
     "replicas must lie within", "spec.prefill.replicas (9) must lie within [minReplicas, maxReplicas] = [1, 4]"),
    ("rdma without mooncake", {"kvTransfer": {"rdmaDevice": "mlx5_0"}},
     "rdmaDevice is only used by the mooncake backend", "rdmaDevice is only used by the mooncake backend"),
    ("absolute path on a pvc", {"model": {"path": "/etc"}}, "model.path must be absolute for source.type image",
     "must be relative to the volume root"),
    ("escaping the volume", {"model": {"path": "../secrets"}}, "model.path must be absolute for source.type image",
     "must be relative to the volume root"),
    ("relative path in an image", {"model": {"source": {"type": "image", "claimName": None}}},
     "model.path must be absolute for source.type image", "must be absolute when source.type is image"),
    ("pvc without claim", {"model": {"source": {"claimName": None}}},
     "source.claimName is required", "claimName is required"),
    ("low watermark 1", {"autoscaling": {"lowWatermark": 1.0}}, "lowWatermark must lie strictly between 0 and 1",
     "lowWatermark must lie strictly between 0 and 1"),
    ("scale to zero without autoscaling", {"decode": {"minReplicas": 0}, "autoscaling": {"enabled": False}},
     "decode.minReplicas 0 (scale to zero) needs autoscaling.enabled",
     "spec.decode.minReplicas 0 (scale to zero) needs spec.autoscaling.enabled"),
    ("gpus not a multiple of tp", {"decode": {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}}},
     "nvidia.com/gpu must be a multiple of tensorParallelSize",
     "spec.decode.resources nvidia.com/gpu (2) must be a multiple of spec.decode.tensorParallelSize (4)"),
    ("prefill gpus not a multiple of tp", {"prefill": {"tensorParallelSize": 2, "resources": {"limits": {
        "nvidia.com/gpu": 3}}}}, "nvidia.com/gpu must be a multiple of tensorParallelSize",
     "spec.prefill.resources nvidia.com/gpu (3) must be a multiple of spec.prefill.tensorParallelSize (2)"),
    ("batched tokens below seqs", {"decode": {"maxNumSeqs": 512, "maxNumBatchedTokens": 256}},
     "maxNumBatchedTokens must be >= maxNumSeqs", "maxNumBatchedTokens (256) must be >= spec.decode.maxNumSeqs (512)"),
]


def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict):
            out[k] = _merge(out.get(k, {}), v)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("what,patch,schema_error,operator_error", INVALID_BY_SCHEMA, ids=[c[0] for c in INVALID_BY_SCHEMA])
def test_schema_rejects(schema, validate, minimal_spec, what, patch, schema_error, operator_error):
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": _merge(minimal_spec, patch)}
    with pytest.raises(jsonschema.ValidationError) as err:
        validate(apply_defaults(schema, obj))
    assert schema_error in err.value.message
    with pytest.raises(SpecError) as err:
        parse_spec("x", "ns", obj["spec"], "img:1")
    assert operator_error in str(err.value)


@pytest.mark.parametrize("what,patch,cel_message,operator_error", INVALID_BY_CEL, ids=[c[0] for c in INVALID_BY_CEL])
def test_cel_rules_reject(schema, validate, minimal_spec, what, patch, cel_message, operator_error):
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": _merge(minimal_spec, patch)}
    defaulted = apply_defaults(schema, obj)
    validate(defaulted)  # passes: only CEL catches these
    with pytest.raises(SpecError) as err:
        parse_spec("x", "ns", obj["spec"], "img:1")
    assert operator_error in str(err.value)
    assert any(cel_message in m for m in cel_failures(schema, defaulted))


def test_name_length_rule(schema, minimal_spec):
    long_name = "n" * 41
    obj = {"metadata": {"name": long_name, "namespace": "ns"}, "spec": minimal_spec}
    assert "metadata.name must be at most 40 characters" in " ".join(cel_failures(schema, obj)[:1])
    with pytest.raises(SpecError, match="at most 40 characters"):
        parse_spec(long_name, "ns", minimal_spec, "img:1")


def test_parse_spec_never_crashes_on_garbage():
    for garbage in (None, [], "spec", {"model": "x"}, {"model": {"servedName": 3, "path": []}},
                    {"autoscaling": {"targetWaitingPerReplica": "lots"}}, {"decode": []}):
        with pytest.raises(SpecError):
            parse_spec("x", "ns", garbage, "img:1")
