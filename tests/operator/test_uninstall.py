"""Deleting InferenceDeployments and uninstalling the operator, in either order,
with the real kopf operator against the fake API server, which deletes as
kube-apiserver does (finalizers hold objects Terminating, garbage collection of
owned children, Terminating namespaces, CRD cleanup; fake_lifecycle.py). Whatever
the order, nothing may be left Terminating.

"Uninstall" is the operator process going away (helm uninstall deletes its
Deployment; the CRD stays, as Helm never deletes crds/), optionally followed by
`kubectl delete crd`.
"""

from __future__ import annotations

import pytest

from .conftest import load_crd
from .fake_kube import ApiError, FakeKube
from .fake_lifecycle import CRDS
from .test_kopf_handlers import (
    IFD,
    KINDS,
    NS,
    child,
    expected_children,
    infd,
    run_operator,
    stop_operator,
    wait_for,
)

CHILD_KINDS = {k: v for k, v in KINDS.items() if k != IFD}
LEGACY_FINALIZER = "splitserve.io/finalizer"  # what kopf's timer added before the operator dropped it


class Cluster:
    """The fake API server with the CRD installed and the operator running."""

    def __init__(self, fake: FakeKube, tmp_path, monkeypatch):
        self.fake, self._args, self._operator = fake, (tmp_path, monkeypatch), None

    async def start_operator(self) -> None:
        self.fake.requests.clear()
        self._operator = await run_operator(self.fake, *self._args)
        # kopf stopped during its first discovery retries it for seconds: let it list first.
        await wait_for(lambda: ("GET", f"/apis/{IFD[0]}/namespaces/{NS}/{IFD[1]}") in self.fake.requests,
                       "kopf's first list of InferenceDeployments")

    async def uninstall(self) -> None:
        if self._operator:
            await stop_operator(*self._operator)
            self._operator = None

    async def deploy(self, name: str, spec: dict) -> dict:
        created = await self.fake.create(*IFD, NS, infd(name, spec))
        await wait_for(lambda: all(child(self.fake, k, n) for _, k, n in expected_children(name, spec)),
                       f"{name}'s children")
        return created

    def leftovers(self, name: str, spec: dict) -> list:
        """The InferenceDeployment or any of its children, if still there."""
        found = [("InferenceDeployment", name)] if self.fake.get(*IFD, NS, name) else []
        return found + [(k, n) for _, k, n in expected_children(name, spec) if child(self.fake, k, n)]


@pytest.fixture
async def cluster(tmp_path, monkeypatch):
    fake = FakeKube(dict(CHILD_KINDS))
    await fake.start()
    await fake.create(*CRDS, None, load_crd())
    await fake.create_namespace(NS)
    c = Cluster(fake, tmp_path, monkeypatch)
    await c.start_operator()
    yield c
    await c.uninstall()
    await fake.stop()


async def test_no_finalizer_while_running(cluster, minimal_spec):
    """kopf adds its finalizer for timers, daemons and mandatory delete handlers;
    the operator has none of them, so no object ever needs the operator to go."""
    await cluster.deploy("llama", minimal_spec)
    status = await wait_for(lambda: (cluster.fake.get(*IFD, NS, "llama") or {}).get("status", {}).get("conditions"),
                            "a status written by the resync")
    assert status
    assert cluster.fake.get(*IFD, NS, "llama")["metadata"].get("finalizers") is None


async def test_delete_then_uninstall(cluster, minimal_spec):
    from splitserve.operator.handlers import METRICS

    await cluster.deploy("llama", minimal_spec)
    labels = {"deployment_namespace": NS, "deployment": "llama", "role": "decode", "state": "desired"}
    await wait_for(lambda: METRICS.registry.get_sample_value("splitserve_operator_replicas", labels) == 1,
                   "the operator's replica gauge")
    await cluster.fake.remove(*IFD, NS, "llama")
    assert cluster.leftovers("llama", minimal_spec) == []  # gone at once: children garbage-collected
    # The operator forgets the deleted object's metric series when it sees the deletion.
    await wait_for(lambda: METRICS.registry.get_sample_value("splitserve_operator_replicas", labels) is None,
                   "the deleted object's metric series to go")
    await cluster.uninstall()
    await cluster.fake.remove("v1", "namespaces", None, NS)
    assert cluster.fake.terminating() == []
    assert cluster.fake.get("v1", "namespaces", None, NS) is None


async def test_foreground_delete_removes_children_first(cluster, minimal_spec):
    await cluster.deploy("llama", minimal_spec)
    await cluster.fake.remove(*IFD, NS, "llama", propagation="Foreground")
    assert cluster.leftovers("llama", minimal_spec) == []
    assert cluster.fake.terminating() == []


async def test_uninstall_then_delete(cluster, minimal_spec):
    await cluster.deploy("llama", minimal_spec)
    await cluster.uninstall()
    await cluster.fake.remove(*IFD, NS, "llama")
    assert cluster.leftovers("llama", minimal_spec) == []
    await cluster.fake.remove("v1", "namespaces", None, NS)
    assert cluster.fake.terminating() == []
    assert cluster.fake.get("v1", "namespaces", None, NS) is None


async def test_uninstall_then_delete_namespace_or_crd(cluster, minimal_spec):
    await cluster.deploy("llama", minimal_spec)
    await cluster.fake.create_namespace("other")
    await cluster.fake.create(*IFD, "other", {**infd("mistral", minimal_spec), "metadata": {"name": "mistral"}})
    await cluster.uninstall()
    await cluster.fake.remove("v1", "namespaces", None, NS)  # kubectl delete namespace demo
    assert cluster.fake.get("v1", "namespaces", None, NS) is None
    assert cluster.leftovers("llama", minimal_spec) == []
    await cluster.fake.remove(*CRDS, None, "inferencedeployments.splitserve.io")  # kubectl delete crd
    assert cluster.fake.get(*IFD, "other", "mistral") is None
    assert cluster.fake.get(*CRDS, None, "inferencedeployments.splitserve.io") is None
    assert cluster.fake.terminating() == []


async def test_finalizer_left_by_an_older_operator_is_released(cluster, minimal_spec):
    """Objects created under a version whose timer added kopf's finalizer lose it
    as soon as this operator sees them, so a later uninstall cannot strand them."""
    await cluster.uninstall()
    body = infd("old", minimal_spec)
    body["metadata"]["finalizers"] = [LEGACY_FINALIZER]
    await cluster.fake.create(*IFD, NS, body)
    await cluster.start_operator()
    await wait_for(lambda: cluster.fake.get(*IFD, NS, "old")["metadata"].get("finalizers") is None,
                   "the legacy finalizer to be removed")
    await cluster.uninstall()
    await cluster.fake.remove(*IFD, NS, "old")
    assert cluster.fake.get(*IFD, NS, "old") is None and cluster.fake.terminating() == []


async def test_the_fake_holds_objects_with_finalizers_like_the_api_server(cluster, minimal_spec):
    """What the tests above rule out: with a finalizer nobody removes, the object
    and its namespace stay Terminating (and no new finalizer may be added)."""
    await cluster.uninstall()
    body = infd("stuck", minimal_spec)
    body["metadata"]["finalizers"] = ["example.com/never-removed"]
    await cluster.fake.create(*IFD, NS, body)
    await cluster.fake.remove("v1", "namespaces", None, NS)
    assert cluster.fake.terminating() == ["InferenceDeployment demo/stuck", "Namespace /demo"]
    assert cluster.fake.get("v1", "namespaces", None, NS)["status"] == {"phase": "Terminating"}
    with pytest.raises(ApiError, match="no new finalizers can be added if the object is being deleted"):
        await cluster.fake.patch_spec(*IFD, NS, "stuck", {"metadata": {"finalizers": ["a", "b"]}})
    await cluster.fake.patch_spec(*IFD, NS, "stuck", {"metadata": {"finalizers": None}})
    assert cluster.fake.terminating() == [] and cluster.fake.get("v1", "namespaces", None, NS) is None
