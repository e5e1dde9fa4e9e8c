"""Extra labels on the ServiceMonitor and PodMonitors the operator creates, so that a
Prometheus selecting monitors by label (kube-prometheus-stack: `release`) scrapes
them: operator-wide from `--monitor-label` (the chart's monitoring.labels), per
InferenceDeployment from spec.monitoring.labels; rendered monitors validate against
prometheus-operator's CRDs, and bad labels are refused by the CRD and parse_spec."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from splitserve.operator.config import OperatorConfig
from splitserve.operator.main import parse_args
from splitserve.operator.render import Replicas, render_all
from splitserve.operator.spec import SpecError, parse_spec

from .conftest import crd_schema, load_crd, third_party_validator
from .crd_values import admit
from .fake_kube import FakeKube
from .fake_lifecycle import CRDS
from .test_kopf_handlers import IFD, KINDS, NS, child, infd, run_operator, stop_operator, wait_for

SCHEMAS = {"ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
           "PodMonitor": "monitoring.coreos.com_podmonitors.yaml"}


def monitored(spec: dict, labels: dict | None = None) -> dict:
    monitoring = {"serviceMonitor": True, "podMonitor": True, **({"labels": labels} if labels else {})}
    return {**copy.deepcopy(spec), "monitoring": monitoring}


def test_monitors_carry_the_spec_labels_under_the_operators_own(minimal_spec):
    spec = parse_spec("llama", "team-a", monitored(minimal_spec, {"release": "kps", "team": "ml"}), "img:1")
    monitors = [m for m in render_all(spec, Replicas(1, 1), "2.60.0") if m["kind"] in SCHEMAS]
    assert sorted((m["kind"], m["metadata"]["name"]) for m in monitors) == [
        ("PodMonitor", "llama-decode"), ("PodMonitor", "llama-prefill"), ("ServiceMonitor", "llama-router")]
    for m in monitors:
        role = m["metadata"]["name"].removeprefix("llama-")
        assert m["metadata"]["labels"] == {
            "release": "kps", "team": "ml", "app.kubernetes.io/name": "splitserve",
            "app.kubernetes.io/component": role, "app.kubernetes.io/managed-by": "splitserve-operator",
            "splitserve.io/deployment": "llama", "app.kubernetes.io/instance": "llama", "splitserve.io/role": role}
        third_party_validator(SCHEMAS[m["kind"]])(m)
    others = [m for m in render_all(spec, Replicas(1, 1), "2.60.0") if m["kind"] not in SCHEMAS]
    assert all("release" not in m["metadata"]["labels"] for m in others)  # only monitors get them


BAD_LABELS = [
    ({"app.kubernetes.io/name": "x"}, "monitoring.labels must not set app.kubernetes.io/ or splitserve.io/ labels",
     "spec.monitoring.labels must not set 'app.kubernetes.io/name': app.kubernetes.io/ and splitserve.io/ labels "
     "are the operator's own"),
    ({"-bad": "x"}, "monitoring.labels keys must be [DNS-subdomain prefix/]name",
     "spec.monitoring.labels key '-bad' is not a label key"),
    ({"release": "not a value"}, "spec.monitoring.labels.release in body should match",
     "spec.monitoring.labels value 'not a value' of 'release' is not a label value"),
]


@pytest.mark.parametrize("labels,crd_error,operator_error", BAD_LABELS, ids=[str(b[0]) for b in BAD_LABELS])
def test_bad_labels_are_refused_by_the_crd_and_parse_spec(minimal_spec, labels, crd_error, operator_error):
    obj = {"apiVersion": "splitserve.io/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x", "namespace": "ns"}, "spec": monitored(minimal_spec, labels)}
    errors = admit(crd_schema(load_crd()), obj)[1]
    assert any(crd_error in e for e in errors), errors
    with pytest.raises(SpecError) as err:
        parse_spec("x", "ns", obj["spec"], "img:1")
    assert operator_error in str(err.value)


def test_operator_flags_and_environment(monkeypatch):
    args = parse_args(["--monitor-label", "release=kps", "--monitor-label", "team=ml"])
    assert args.monitor_labels == {"release": "kps", "team": "ml"}
    for bad in (["--monitor-label", "release"], ["--monitor-label", "splitserve.io/role=x"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    monkeypatch.setenv("SPLITSERVE_OPERATOR_MONITOR_LABELS", '{"release": "kps"}')
    assert OperatorConfig.from_env().monitor_labels == {"release": "kps"}
    monkeypatch.setenv("SPLITSERVE_OPERATOR_MONITOR_LABELS", '{"release": "a b"}')
    with pytest.raises(SystemExit, match="value 'a b' of 'release' is not a label value"):
        OperatorConfig.from_env()


async def test_operator_applies_its_labels_and_the_specs(tmp_path, monkeypatch, minimal_spec):
    """Through kopf: --monitor-label labels on every monitor, the spec's added (and
    winning for the same key)."""
    from splitserve.operator import handlers

    monkeypatch.setattr(handlers, "CONFIG", replace(handlers.CONFIG, monitor_labels={"release": "kps", "team": "x"}))
    fake = FakeKube({k: v for k, v in KINDS.items() if k != IFD})
    await fake.start()
    await fake.create(*CRDS, None, load_crd())
    await fake.create_namespace(NS)
    operator = await run_operator(fake, tmp_path, monkeypatch)
    try:
        await fake.create(*IFD, NS, infd("llama", monitored(minimal_spec, {"team": "ml"})))
        monitor = await wait_for(lambda: child(fake, "ServiceMonitor", "llama-router"), "the router's ServiceMonitor")
        assert {"release": "kps", "team": "ml"}.items() <= monitor["metadata"]["labels"].items()
        pod_monitor = await wait_for(lambda: child(fake, "PodMonitor", "llama-decode"), "the decode PodMonitor")
        assert {"release": "kps", "team": "ml"}.items() <= pod_monitor["metadata"]["labels"].items()
    finally:
        await stop_operator(*operator)
        await fake.stop()
