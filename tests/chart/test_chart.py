"""The Helm chart, rendered by Helm's own engine (helm-python-sdk, no helm binary):
lint, values schema, every object validated (core kinds with kubernetes-validate,
ServiceMonitor / PrometheusRule against the real prometheus-operator CRDs, the
example InferenceDeployment against our CRD), least-privilege RBAC, hardening."""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitserve.operator.kube import PLURALS
from splitserve.operator.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts/splitserve"
SCHEMAS = REPO.parent / "shared" / "schemas"
K8S_VERSION = kubernetes_validate.latest_version()
THIRD_PARTY = {"ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
               "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
               "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
               "RayCluster": "ray.io_rayclusters.yaml"}

ALL_ON = {
    "image": {"tag": "0.1.0-rc1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "operator": {"watchNamespaces": ["team-a", "team-b"], "resyncSeconds": 5, "verbose": True,
                 "postEvents": False, "rayVersion": "2.60.0", "workloadImage": "registry.internal/splitserve:gpu",
                 "tolerations": [{"key": "infra", "operator": "Exists"}], "nodeSelector": {"pool": "system"}},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}},
    "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus"},
                       "thresholds": {"ttftP99Seconds": 1.5}},
    "dashboards": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "LLM"}},
    "example": {"create": True, "name": "demo", "gpus": 2},
}
VALUE_SETS = {"defaults": {}, "all-on": ALL_ON,
              "no-rbac-existing-sa": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}}}


class UniqueKeyLoader(yaml.SafeLoader):
    """Duplicate mapping keys are an error (kubectl would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        if dupes:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {dupes}", node.start_mark)
        return super().construct_mapping(node, deep)


def render(values: dict) -> dict[str, list[dict]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="ss", namespace="splitserve-system", is_install=True)
    docs: dict[str, list[dict]] = {}
    for path, text in out.items():
        if path.endswith(".txt"):
            continue
        docs[path] = [d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d]
    return docs


def objects(values: dict) -> list[dict]:
    return [d for docs in render(values).values() for d in docs]


def third_party(kind: str) -> dict:
    if not SCHEMAS.is_dir():
        pytest.skip(f"third-party CRD schemas not found at {SCHEMAS} (shared/schemas next to the repo)")
    crd = yaml.safe_load((SCHEMAS / "crds" / THIRD_PARTY[kind]).read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def test_lint_is_clean():
    for values in VALUE_SETS.values():
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates(name):
    kinds = []
    for obj in objects(VALUE_SETS[name]):
        kinds.append(obj["kind"])
        if obj["kind"] in THIRD_PARTY:
            # No check_schema: the PrometheusRule CRD has a Go-only regex ('^(?i)...')
            # that Python's re rejects; it is on a field we never set.
            jsonschema.Draft202012Validator(third_party(obj["kind"])).validate(obj)
        elif obj["kind"] == "InferenceDeployment":
            crd = yaml.safe_load((CHART / "crds/inferencedeployments.splitserve.io.yaml").read_text())
            jsonschema.validate(obj, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
            parse_spec(obj["metadata"]["name"], obj["metadata"]["namespace"], obj["spec"], "img:1")
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    if name == "all-on":
        assert {"ServiceMonitor", "PrometheusRule", "ConfigMap", "InferenceDeployment", "RoleBinding"} <= set(kinds)
        assert kinds.count("RoleBinding") == 2


def test_crd_ships_in_crds_dir_and_validates():
    with helm.Chart.load(CHART) as chart:
        (crd,) = chart.crds
    obj = yaml.load(crd["data"], Loader=UniqueKeyLoader)
    assert obj["metadata"]["name"] == "inferencedeployments.splitserve.io"
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_values_schema_rejects_bad_values():
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(ALL_ON)
        for bad in ({"operator": {"resyncSeconds": 0}}, {"operator": {"watchNamespaces": ["Bad_NS"]}},
                    {"prometheusRule": {"thresholds": {"kvCacheUsage": 1.5}}}, {"replicaCount": 3},
                    {"image": {"pullPolicy": "Sometimes"}}, {"example": {"name": "x" * 41}}):
            with pytest.raises(helm.HelmError):
                chart.validate_schema(bad)
        with pytest.raises(helm.HelmError):
            chart.render({"operator": {"resyncSeconds": -1}}, name="ss", namespace="x")


def _rbac(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs
            if o["apiVersion"].startswith("rbac.authorization.k8s.io")}


def test_rbac_is_least_privilege():
    rbac = _rbac(objects({}))
    main = rbac[("ClusterRole", "ss-splitserve")]["rules"]
    for rule in main + rbac[("ClusterRole", "ss-splitserve-discovery")]["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert not {"pods", "configmaps"} & set(rule["resources"])
        assert "secrets" not in rule["resources"] or set(rule["verbs"]) == {"get", "create", "delete"}  # the token
        assert not {"deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
        # update only where OwnerReferencesPermissionEnforcement needs it (blockOwnerDeletion)
        assert "update" not in rule["verbs"] or rule["resources"] == ["inferencedeployments/finalizers"]
    granted = {r: set(rule["verbs"]) for rule in main for r in rule["resources"]}
    # Every kind the operator writes (kube.PLURALS) can be read, applied and deleted.
    for plural in set(PLURALS.values()) - {"inferencedeployments", "secrets"}:
        assert granted[plural] == {"get", "create", "patch", "delete"}, plural
    assert granted["inferencedeployments"] == {"get", "list", "watch", "patch"}
    assert granted["inferencedeployments/status"] == {"get", "patch"}
    assert granted["inferencedeployments/finalizers"] == {"update"}
    assert granted["events"] == {"create"}
    assert ("ClusterRoleBinding", "ss-splitserve") in rbac


def test_secrets_get_create_delete_only():
    """The cluster token Secret: `get`, `create`, and `delete` (which owner references
    require), never list, watch or update; rbac.readSecrets adds nothing beyond that."""
    for values in ({}, {"rbac": {"readSecrets": True}}):
        rules = _rbac(objects(values))[("ClusterRole", "ss-splitserve")]["rules"]
        assert [rule for rule in rules if "secrets" in rule["resources"]] == [
            {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]}]


def test_watch_namespaces_binds_per_namespace_only():
    objs = objects(ALL_ON)
    rbac = _rbac(objs)
    assert ("ClusterRoleBinding", "ss-splitserve") not in rbac
    bindings = [o for o in objs if o["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    operator = next(o for o in objs if o["kind"] == "Deployment")
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--no-events" in args
    assert "--image=registry.internal/splitserve:gpu" in args and "--ray-version=2.60.0" in args


def test_operator_pod_is_hardened_and_matches_the_redis_policy():
    from splitserve.operator.render_policy import OPERATOR_POD_LABELS

    (operator,) = [o for o in objects({}) if o["kind"] == "Deployment"]
    pod = operator["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "ghcr.io/splitserve/splitserve:0.1.0"
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
                                    "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert operator["spec"]["strategy"] == {"type": "Recreate"} and operator["spec"]["replicas"] == 1
    labels = operator["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= labels.items()


def test_dashboards_are_sidecar_configmaps():
    maps = [o for o in objects(ALL_ON) if o["kind"] == "ConfigMap"]
    assert len(maps) == 2
    titles = set()
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
        (body,) = cm["data"].values()
        titles |= {p["title"] for p in json.loads(body)["panels"]}
    for wanted in ("Time to first token", "Inter-token latency", "Token throughput", "Waiting requests per role",
                   "Replicas per role (desired vs ready)", "Scaling events", "KV cache usage",
                   "Prefix cache hit rate (tokens)", "KV transfer bandwidth", "KV transfer latency",
                   "Migrations (decode worker lost mid-stream)", "Errors by HTTP status"):
        assert wanted in titles


def test_notes_render():
    with helm.Chart.load(CHART) as chart:
        notes = chart.render(ALL_ON, name="ss", namespace="splitserve-system")["splitserve/templates/NOTES.txt"]
    assert "watching: team-a, team-b" in notes and "kubectl get infd" in notes
    assert "port-forward svc/demo-router 8000" in notes
