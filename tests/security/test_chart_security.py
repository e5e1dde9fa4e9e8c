"""Every Kubernetes permission and pod privilege the project ships, enumerated and held
to a documented allow-list (docs/reliability.md, "Kubernetes hardening"): the chart
rendered by Helm's engine for each value set, and the workloads the operator renders
for each example InferenceDeployment. Anything beyond the list fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import parse_spec
from tests.chart.test_chart import VALUE_SETS, objects

REPO = Path(__file__).resolve().parents[2]

# (apiGroup, resource) -> verbs the operator may use. Nothing else: no Secrets, no Pods,
# no wildcards, no escalate/bind/impersonate.
ALLOWED_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
    ("splitserve.io", "inferencedeployments"): {"get", "list", "watch", "patch"},
    ("splitserve.io", "inferencedeployments/status"): {"get", "patch"},
    # blockOwnerDeletion on the children's ownerReferences (OwnerReferencesPermissionEnforcement)
    ("splitserve.io", "inferencedeployments/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "create", "patch", "delete"},
    ("", "services"): {"get", "create", "patch", "delete"},
    ("ray.io", "rayclusters"): {"get", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    ("monitoring.coreos.com", "servicemonitors"): {"get", "create", "patch", "delete"},
    ("monitoring.coreos.com", "podmonitors"): {"get", "create", "patch", "delete"},
    ("", "events"): {"create"},
    # The cluster token Secret per InferenceDeployment (issue 36): never list, watch or update;
    # delete only because an owner reference needs it (OwnerReferencesPermissionEnforcement).
    ("", "secrets"): {"get", "create", "delete"},
    ("cert-manager.io", "certificates"): {"get", "create", "patch", "delete"},  # spec.tls.certManager
}
# Ports of worker pods open beyond the deployment's own pods: metrics/health only.
OPEN_WORKER_PORTS = {8081, 8082}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "RayCluster"}


def rbac_rules(manifests: list[dict]) -> list[tuple[str, str, str, str]]:
    """(role name, apiGroup, resource, verb) for every rule of every (Cluster)Role."""
    out = []
    for m in manifests:
        if m["kind"] not in ("Role", "ClusterRole"):
            continue
        assert "aggregationRule" not in m, m["metadata"]["name"]
        for rule in m.get("rules", []):
            assert not rule.get("resourceNames") or rule["resources"], rule
            assert not rule.get("nonResourceURLs"), (m["metadata"]["name"], rule)
            for group in rule.get("apiGroups", []):
                for resource in rule.get("resources", []):
                    for verb in rule.get("verbs", []):
                        out.append((m["metadata"]["name"], group, resource, verb))
    return out


def pod_specs(manifest: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template in a workload."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    if kind == "RayCluster":
        spec = manifest["spec"]
        groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
        return [(f"{kind}/{name}/{g}", grp["template"]["spec"]) for g, grp in groups]
    if kind == "CronJob":
        return [(f"{kind}/{name}", manifest["spec"]["jobTemplate"]["spec"]["template"]["spec"])]
    return [(f"{kind}/{name}", manifest["spec"]["template"]["spec"])]


def assert_hardened(where: str, pod: dict) -> None:
    sc = pod.get("securityContext", {})
    assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 1) != 0, (where, sc)
    assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", (where, sc)
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(flag), (where, flag)
    assert not any("hostPath" in v for v in pod.get("volumes", [])), where
    for c in pod.get("initContainers", []) + pod["containers"]:
        csc = c.get("securityContext", {})
        who = f"{where}/{c['name']}"
        assert csc.get("readOnlyRootFilesystem") is True, (who, csc)
        assert csc.get("allowPrivilegeEscalation") is False, (who, csc)
        assert not csc.get("privileged"), (who, csc)
        assert csc.get("capabilities", {}).get("drop") == ["ALL"], (who, csc)
        assert not csc.get("capabilities", {}).get("add"), (who, csc)
        assert csc.get("runAsUser", 1) != 0, (who, csc)
        assert csc.get("seccompProfile", {"type": "RuntimeDefault"})["type"] == "RuntimeDefault", (who, csc)


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_chart_rbac_is_exactly_the_documented_list(values):
    rules = rbac_rules(objects(VALUE_SETS[values]))
    if values == "no-rbac-existing-sa":
        assert rules == []
        return
    granted: dict[tuple[str, str], set[str]] = {}
    for _, group, resource, verb in rules:
        assert "*" not in (group, resource, verb), (group, resource, verb)
        assert verb not in ("escalate", "bind", "impersonate"), (group, resource, verb)
        granted.setdefault((group, resource), set()).add(verb)
    extra = {k: v - ALLOWED_RULES.get(k, set()) for k, v in granted.items() if v - ALLOWED_RULES.get(k, set())}
    assert not extra, f"permissions beyond the documented list: {extra}"
    assert granted == ALLOWED_RULES  # and the list itself stays current


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_chart_pods_are_hardened(values):
    workloads = [m for m in objects(VALUE_SETS[values]) if m["kind"] in WORKLOAD_KINDS]
    assert workloads
    for m in workloads:
        for where, pod in pod_specs(m):
            assert_hardened(where, pod)


def example_specs():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        yield path.name, parse_spec(obj["metadata"]["name"], obj["metadata"]["namespace"], obj["spec"], "img:1")


@pytest.mark.parametrize("name, spec", list(example_specs()), ids=lambda x: x if isinstance(x, str) else "")
def test_operator_workloads_are_hardened_and_worker_ports_closed(name, spec):
    manifests = render_all(spec, Replicas(2, 2), "2.60.0")
    for m in manifests:
        if m["kind"] in WORKLOAD_KINDS:
            for where, pod in pod_specs(m):
                assert_hardened(where, pod)
    policies = {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in manifests
                if m["kind"] == "NetworkPolicy"}
    if not spec.network_policy:
        return
    for role in ("decode", "prefill"):
        pol = policies[role]["spec"]
        assert pol["policyTypes"] == ["Ingress"], role
        for rule in pol["ingress"]:
            if "from" in rule:  # only this deployment's pods: its router and peer workers (and Redis)
                assert rule["from"] == [{"podSelector": {"matchLabels": {"splitserve.io/deployment": spec.name}}}], \
                    (role, rule)
            else:  # from anywhere: only metrics/health ports
                assert {p["port"] for p in rule["ports"]} <= OPEN_WORKER_PORTS, (role, rule)
