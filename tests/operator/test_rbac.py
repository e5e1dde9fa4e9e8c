"""The chart's ClusterRoles grant everything the operator does: the real kopf
operator runs against the fake API server authorizing every request with the rules
rendered from the chart, plus OwnerReferencesPermissionEnforcement (the admission
plugin behind `inferencedeployments/finalizers`: blockOwnerDeletion on a child's
owner reference needs `update` on the owner's finalizers)."""

from __future__ import annotations

import pytest

from tests.chart.test_chart import objects

from .conftest import load_crd
from .fake_kube import FakeKube
from .fake_lifecycle import CRDS
from .test_kopf_handlers import (
    IFD,
    KINDS,
    NS,
    child,
    condition,
    expected_children,
    infd,
    run_operator,
    stop_operator,
)
from .test_kopf_handlers import wait_for as wait_until

FINALIZERS_RULE = {"apiGroups": ["splitserve.io"], "resources": ["inferencedeployments/finalizers"],
                   "verbs": ["update"]}


def chart_rules() -> list[dict]:
    """The operator's rules: both ClusterRoles of a default install."""
    return [rule for o in objects({}) if o["kind"] == "ClusterRole" for rule in o["rules"]]


def monitored(spec: dict) -> dict:
    """Every optional child on: ServiceMonitor, PodMonitors, NetworkPolicies, Redis."""
    return {**spec, "monitoring": {"serviceMonitor": True, "podMonitor": True}}


@pytest.fixture
async def start(tmp_path, monkeypatch):
    running = []

    async def start_with(rules: list[dict]) -> FakeKube:
        fake = FakeKube({k: v for k, v in KINDS.items() if k != IFD}, rbac_rules=rules)
        await fake.start()
        await fake.create(*CRDS, None, load_crd())  # by the test, as cluster admin
        await fake.create_namespace(NS)
        running.append((fake, await run_operator(fake, tmp_path, monkeypatch)))
        return fake
    yield start_with
    for fake, operator in running:
        await stop_operator(*operator)
        await fake.stop()


async def test_the_chart_grants_every_request_the_operator_makes(start, minimal_spec):
    rules = chart_rules()
    assert FINALIZERS_RULE in rules
    fake = await start(rules)
    spec = monitored(minimal_spec)
    await fake.create(*IFD, NS, infd("llama", spec))
    wanted = expected_children("llama", spec)
    await wait_until(lambda: all(child(fake, k, n) for _, k, n in wanted), "every child, monitors included")
    await wait_until(lambda: (condition(fake, "llama", "Ready") or {}).get("reason") == "RolesNotReady",
                     "status written through the status subresource")
    assert fake.denied == []
    methods = {m for m, _ in fake.requests}
    assert {"GET", "PATCH"} <= methods  # reads and server-side applies went through the authorizer


async def test_without_finalizers_update_children_cannot_block_owner_deletion(start, minimal_spec):
    fake = await start([r for r in chart_rules() if r != FINALIZERS_RULE])
    await fake.create(*IFD, NS, infd("llama", minimal_spec))
    degraded = await wait_until(
        lambda: (c := condition(fake, "llama", "Degraded")) and c["status"] == "True" and c, "Degraded")
    # The first owned child the operator creates is the cluster token Secret; nothing after it.
    assert degraded["reason"] == "ClusterTokenUnavailable"
    assert condition(fake, "llama", "Progressing")["message"] == "blocked until the cause is fixed"
    assert "cannot read or create the cluster token Secret demo/llama-cluster-token: HTTP 403" in degraded["message"]
    assert child(fake, "Deployment", "llama-decode") is None and child(fake, "Secret", "llama-cluster-token") is None
    assert any('secrets "llama-cluster-token" is forbidden: cannot set blockOwnerDeletion if an ownerReference '
               "refers to a resource you can't set "
               'finalizers on: inferencedeployments.splitserve.io "llama" is forbidden: User '
               '"system:serviceaccount:splitserve-system:ss-splitserve" cannot update resource '
               '"inferencedeployments/finalizers" in API group "splitserve.io" in the namespace "demo"' in d
               for d in fake.denied)
