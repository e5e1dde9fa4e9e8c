"""The CRD's per-role pod settings, spec.redis.urlSecretRef and spec.model.source uri:
the embedded Kubernetes types are Kubernetes' own schemas (in sync with the
generator), and every bad value gets the exact message, from the API server's
checks (crd_values.admit: OpenAPI, then CEL on cel-python) and from parse_spec alike.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

from splitserve.core.model_uri import URI_RULE, parse_model_uri
from splitserve.operator.spec import SpecError, parse_spec
from splitserve.operator.spec_pod import OPERATOR_ENV, OPERATOR_LABELS, OPERATOR_VOLUMES

from .conftest import CRD_PATH, REPO, crd_schema, load_crd
from .crd_values import admit

ROLES = ("router", "prefill", "decode")
POD_FIELDS = ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName", "env",
              "envFrom", "volumes", "volumeMounts", "podAnnotations", "podLabels", "imagePullSecrets")


@pytest.fixture(scope="module")
def schema() -> dict:
    return crd_schema(load_crd(), "v1alpha1")


def generator():
    spec = importlib.util.spec_from_file_location("crd_k8s_types", REPO / "scripts/crd_k8s_types.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def errors_of(schema: dict, spec: dict) -> list[str]:
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": spec}
    return admit(schema, obj)[1]


def problems_of(spec: dict) -> list[str]:
    try:
        parse_spec("x", "ns", spec, "img:1")
    except SpecError as exc:
        return exc.problems
    return []


def with_role(minimal_spec: dict, role: str, **fields) -> dict:
    spec = copy.deepcopy(minimal_spec)
    spec[role] = fields
    return spec


def test_embedded_kubernetes_types_are_generated_and_current():
    """Every marked block is exactly what scripts/crd_k8s_types.py writes from
    Kubernetes' schema: a hand edit, or a generator change not run, fails here."""
    text = CRD_PATH.read_text()
    gen = generator()
    assert gen.regenerate(text) == text, "run: python scripts/crd_k8s_types.py"
    assert sorted(gen.MARKER.match(line)["type"] for line in text.splitlines() if gen.MARKER.match(line)) == \
        sorted(gen.TYPES)
    decode = crd_schema(load_crd())["properties"]["spec"]["properties"]["decode"]["properties"]
    assert decode["affinity"] == gen.embedded_type("Affinity")
    assert decode["volumes"]["items"] == gen.embedded_type("Volume")


def test_every_role_has_the_same_pod_settings(schema):
    roles = schema["properties"]["spec"]["properties"]
    for name in POD_FIELDS:
        assert roles["router"]["properties"][name] == roles["prefill"]["properties"][name] \
            == roles["decode"]["properties"][name], name
    mounts_rule = roles["router"]["x-kubernetes-validations"][0]
    assert all(mounts_rule in roles[r]["x-kubernetes-validations"] for r in ROLES)


def test_bad_affinity_content_is_refused_by_kubernetes_own_schema(schema, minimal_spec):
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "values": ["h100"]}]}]}}}
    where = "spec.decode.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution." \
            "nodeSelectorTerms[0].matchExpressions[0].operator"
    assert errors_of(schema, with_role(minimal_spec, "decode", affinity=affinity)) == [f"{where}: Required value"]
    spread = [{"maxSkew": "one", "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]
    where = "spec.router.topologySpreadConstraints[0].maxSkew"
    assert errors_of(schema, with_role(minimal_spec, "router", topologySpreadConstraints=spread)) == [
        f'{where}: Invalid value: "one": {where} in body must be of type integer: "string"']


ENV_RULE = ("env must not set POD_NAME, POD_NAMESPACE, POD_IP, HOME, HF_HUB_OFFLINE, HF_TOKEN, SPLITSERVE_REDIS_URL: "
            "the operator sets them (the Hugging Face token comes from model.source.tokenSecretRef)")
VOLUME_RULE = "volumes[].name must not be tmp, dshm, model, cluster-token or cluster-tls: the operator's own volumes have those names"
MOUNT_PATH_RULE = ("volumeMounts[].mountPath must not be /tmp, /dev/shm, /models, /etc/splitserve/cluster-token, "
                   "/etc/splitserve/tls or below them: the operator mounts its own volumes there")
MOUNT_NAME_RULE = "volumeMounts[].name must name one of this role's volumes"
KEY_RULE = ("keys must be [DNS-subdomain prefix/]name, the name at most 63 letters, digits, '-', '_' or '.', "
            "beginning and ending with a letter or digit")
LABEL_RULE = ("podLabels must not set app.kubernetes.io/name, component, managed-by or instance, nor any "
              "splitserve.io/ or ray.io/ label: selectors and KubeRay rely on them")
SCRATCH = [{"name": "scratch", "emptyDir": {}}]

# (what, role, fields, the node the rule sits on (None: the role), its message). The API
# server reports "<path>: Invalid value: <type>: <message>"; parse_spec "spec.<role>.<message>".
BAD_POD_SETTINGS = [
    ("env sets the Redis URL", "decode", {"env": [{"name": "SPLITSERVE_REDIS_URL", "value": "redis://x:6379"}]},
     "env", ENV_RULE),
    ("volume named model", "prefill", {"volumes": [{"name": "model", "emptyDir": {}}]}, "volumes", VOLUME_RULE),
    ("mount over /dev/shm", "decode", {"volumes": SCRATCH, "volumeMounts": [{"name": "scratch", "mountPath": "/dev/shm/"}]},
     "volumeMounts", MOUNT_PATH_RULE),
    ("mount below /models", "router", {"volumes": SCRATCH, "volumeMounts": [{"name": "scratch", "mountPath": "/models/x"}]},
     "volumeMounts", MOUNT_PATH_RULE),
    ("mount over the cluster token", "decode", {"volumes": SCRATCH, "volumeMounts": [
        {"name": "scratch", "mountPath": "/etc/splitserve/cluster-token"}]}, "volumeMounts", MOUNT_PATH_RULE),
    ("mount of a missing volume", "router", {"volumeMounts": [{"name": "certs", "mountPath": "/etc/certs"}]},
     None, MOUNT_NAME_RULE),
    ("label key with a space", "decode", {"podLabels": {"my team": "a"}}, "podLabels", f"podLabels {KEY_RULE}"),
    ("selector label", "prefill", {"podLabels": {"splitserve.io/role": "decode"}}, "podLabels", LABEL_RULE),
    ("annotation key with two slashes", "decode", {"podAnnotations": {"a/b/c": "x"}}, "podAnnotations",
     f"podAnnotations {KEY_RULE}"),
]


@pytest.mark.parametrize("what,role,fields,node,message", BAD_POD_SETTINGS, ids=[c[0] for c in BAD_POD_SETTINGS])
def test_bad_pod_settings_get_clear_messages(schema, minimal_spec, what, role, fields, node, message):
    spec = with_role(minimal_spec, role, **fields)
    path, kind = (f"spec.{role}.{node}", "array" if isinstance(fields[node], list) else "object") if node \
        else (f"spec.{role}", "object")
    assert errors_of(schema, spec) == [f'{path}: Invalid value: "{kind}": {message}']
    assert problems_of(spec) == [f"spec.{role}.{message}"]


@pytest.mark.parametrize("field,values", [("priorityClassName", "High_Priority"), ("podLabels", {"team": "ml platform"}),
                                          ("imagePullSecrets", ["Registry"])])
def test_bad_names_are_refused_by_the_schema(schema, minimal_spec, field, values):
    spec = with_role(minimal_spec, "decode", **{field: values})
    (error,) = errors_of(schema, spec)
    assert "in body should match" in error and error.startswith(f"spec.decode.{field}")
    (problem,) = problems_of(spec)
    assert problem.startswith(f"spec.decode.{field}")


def test_every_reserved_name_is_refused_everywhere(schema, minimal_spec):
    """The names the CEL rules list are exactly the ones spec_pod reserves (the renderer's own)."""
    for name in OPERATOR_ENV:
        spec = with_role(minimal_spec, "router", env=[{"name": name, "value": "x"}])
        assert len(errors_of(schema, spec)) == len(problems_of(spec)) == 1, name
    for name in OPERATOR_VOLUMES:
        spec = with_role(minimal_spec, "prefill", volumes=[{"name": name, "emptyDir": {}}])
        assert len(errors_of(schema, spec)) == len(problems_of(spec)) == 1, name
    for key in OPERATOR_LABELS + ("splitserve.io/anything", "ray.io/node-type"):
        spec = with_role(minimal_spec, "decode", podLabels={key: "x"})
        assert len(errors_of(schema, spec)) == len(problems_of(spec)) == 1, key
    fine = with_role(minimal_spec, "decode", env=[{"name": "SPLITSERVE_API_KEY_FILE", "value": "/k"}],
                     volumes=SCRATCH, volumeMounts=[{"name": "scratch", "mountPath": "/tmp/scratch"}],
                     podLabels={"app.kubernetes.io/part-of": "search", "team": "ml"})
    assert errors_of(schema, fine) == [] and problems_of(fine) == []


def test_parse_spec_never_crashes_on_garbage_pod_settings(minimal_spec):
    for fields, problem in (({"topologySpreadConstraints": ["zone"]}, "topologySpreadConstraints must be a list of objects"),
                            ({"imagePullSecrets": [{"name": "x"}]}, "imagePullSecrets must be a list of strings"),
                            ({"podLabels": ["team"]}, "podLabels must be an object")):
        assert problems_of(with_role(minimal_spec, "decode", **fields)) == [f"spec.decode.{problem}"]


def test_redis_url_and_secret_are_mutually_exclusive(schema, minimal_spec):
    spec = {**minimal_spec, "redis": {"url": "redis://r:6379/0", "urlSecretRef": {"name": "redis", "key": "url"}}}
    message = "redis.url and redis.urlSecretRef are mutually exclusive: keep the URL in the Secret and leave url unset"
    assert errors_of(schema, spec) == [f'spec.redis: Invalid value: "object": {message}']
    assert problems_of(spec) == [f"spec.{message}"]
    spec["redis"] = {"urlSecretRef": {"name": "redis"}}
    assert errors_of(schema, spec) == ["spec.redis.urlSecretRef.key: Required value"]
    assert problems_of(spec) == ["spec.redis.urlSecretRef needs name and key (a key of a Secret in this namespace)"]


def uri_spec(minimal_spec: dict, **source) -> dict:
    return {**minimal_spec, "model": {**minimal_spec["model"], "source": {"type": "uri", **source}}}


@pytest.mark.parametrize("uri", ["s3://models/llama-3-8b", "hf://llama-3-8b", "hf://meta-llama/Llama 3", "https://huggingface.co/x/y",
                                 "hf://org/name@", "hf://../name"])
def test_unsupported_uris_say_so(schema, minimal_spec, uri):
    spec = uri_spec(minimal_spec, uri=uri)
    assert URI_RULE.startswith("source.uri must be hf://ORG/NAME[@REVISION] when source.type is uri (s3:// is not supported")
    assert errors_of(schema, spec) == [f'spec.model.source: Invalid value: "object": {URI_RULE}']
    assert problems_of(spec) == [f"spec.model.{URI_RULE}"]


@pytest.mark.parametrize("uri,repo,revision", [
    ("hf://meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", None),
    ("hf://Qwen/Qwen2.5-0.5B-Instruct@main", "Qwen/Qwen2.5-0.5B-Instruct", "main"),
    ("hf://org/name@refs/pr/12", "org/name", "refs/pr/12"),
    ("hf://org/name@0e9e39f249a16976918f6564b8830bc894c89659", "org/name", "0e9e39f249a16976918f6564b8830bc894c89659")])
def test_hf_uris_are_accepted(schema, minimal_spec, uri, repo, revision):
    spec = uri_spec(minimal_spec, uri=uri, tokenSecretRef={"name": "hf", "key": "token"})
    assert errors_of(schema, spec) == [] and problems_of(spec) == []
    assert (parse_model_uri(uri).repo_id, parse_model_uri(uri).revision) == (repo, revision)


def test_uri_fields_belong_to_type_uri(schema, minimal_spec):
    spec = copy.deepcopy(minimal_spec)
    spec["model"]["source"]["tokenSecretRef"] = {"name": "hf", "key": "token"}
    message = "source.uri and source.tokenSecretRef are only used by source.type uri"
    assert errors_of(schema, spec) == [f'spec.model.source: Invalid value: "object": {message}']
    assert problems_of(spec) == [f"spec.model.{message}"]
    spec = uri_spec(minimal_spec)
    assert errors_of(schema, spec) == [f'spec.model.source: Invalid value: "object": {URI_RULE}']
    spec = uri_spec(minimal_spec, uri="hf://org/name")
    spec["model"]["tokenizer"] = "other-tokenizer"
    message = "model.tokenizer must lie inside model.path when source.type is uri (only that snapshot is downloaded)"
    assert errors_of(schema, spec) == [f'spec.model: Invalid value: "object": {message}']
    assert problems_of(spec) == [f"spec.{message}"]
