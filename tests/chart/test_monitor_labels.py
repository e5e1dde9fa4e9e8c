"""monitoring.labels: extra labels (kube-prometheus-stack's `release`) on the chart's
ServiceMonitor and PrometheusRule, passed to the operator for the monitors it
creates; validated against prometheus-operator's CRDs and by the values schema."""

from __future__ import annotations

import helm_python as helm
import jsonschema
import pytest

from .test_chart import CHART, objects, third_party

VALUES = {"monitoring": {"labels": {"release": "kube-prometheus-stack", "team": "llm"}},
          "serviceMonitor": {"enabled": True, "labels": {"team": "platform"}}, "prometheusRule": {"enabled": True}}


def test_monitors_rules_and_operator_get_the_labels():
    objs = {o["kind"]: o for o in objects(VALUES)}
    assert objs["ServiceMonitor"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert objs["ServiceMonitor"]["metadata"]["labels"]["team"] == "platform"  # serviceMonitor.labels win
    assert objs["PrometheusRule"]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert objs["PrometheusRule"]["metadata"]["labels"]["team"] == "llm"
    for kind in ("ServiceMonitor", "PrometheusRule"):
        jsonschema.Draft202012Validator(third_party(kind)).validate(objs[kind])
    args = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--monitor-label")] == [
        "--monitor-label=release=kube-prometheus-stack", "--monitor-label=team=llm"]


def test_no_labels_no_flags():
    (operator,) = [o for o in objects({}) if o["kind"] == "Deployment"]
    assert not [a for a in operator["spec"]["template"]["spec"]["containers"][0]["args"] if "monitor-label" in a]


@pytest.mark.parametrize("labels", [{"app.kubernetes.io/name": "x"}, {"splitserve.io/role": "x"}, {"-x": "y"},
                                    {"release": "a b"}, {"release": "x" * 64}])
def test_values_schema_refuses_bad_labels(labels):
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(VALUES)
        with pytest.raises(helm.HelmError):
            chart.validate_schema({"monitoring": {"labels": labels}})
