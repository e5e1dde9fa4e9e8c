"""The label names the chart's alerts and dashboards use exist on the series as
Prometheus stores them after a scrape by prometheus-operator's ServiceMonitor /
PodMonitor: the metric's own labels plus the target labels (namespace, pod, ...).

A metric label named like a target label would be renamed exported_<name> by the
scrape (no honorLabels), which is how the operator's panels once came out empty. The
operator's series are scraped in the operator's namespace, so their `namespace` says
nothing about an InferenceDeployment: queries on them must use deployment_namespace.

Label sets are followed through each expression (promql-parser's syntax tree):
selectors and matchers, aggregations (by/without), label_replace, histogram_quantile,
binary operators with on/ignoring/group_left; then legend formats, annotation
templates and alert annotations ($labels.x) are checked against the result."""

from __future__ import annotations

import json
import re

import promql_parser as pp

from splitserve.metrics import Metrics

from .test_chart import ALL_ON, objects

TARGET_LABELS = {"namespace", "service", "pod", "container", "endpoint", "job", "instance"}
OPERATOR_PREFIX = "splitserve_operator_"  # scraped from the operator's pod, in its own namespace


def scraped_labels() -> dict[str, set[str]]:
    """Series name -> the label names it has in Prometheus."""
    out = {}
    for collector in list(Metrics().registry._collector_to_names):  # noqa: SLF001
        own = set(getattr(collector, "_labelnames", ()))  # the process collector has none
        for metric in (collector.describe() if hasattr(collector, "describe") else collector.collect()):
            base, labels = metric.name, own | TARGET_LABELS
            if metric.name.startswith(OPERATOR_PREFIX):
                labels = labels - {"namespace"}  # the operator's own: meaningless in a query
            if metric.type == "histogram":
                out.update({f"{base}_bucket": labels | {"le"}, f"{base}_sum": labels, f"{base}_count": labels})
            elif metric.type == "counter":
                out.update({f"{base}_total": labels, f"{base}_created": labels})
            else:
                out[base] = labels
    return out


SCRAPED = scraped_labels()
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


class Labels:
    """Follows label sets through a PromQL expression, collecting misuses."""

    def __init__(self):
        self.problems: list[str] = []

    def need(self, wanted, have: set[str], what: str) -> None:
        for label in wanted:
            if label not in have:
                self.problems.append(f"{what} uses label {label!r}, which its input lacks ({sorted(have)})")

    def of(self, node) -> set[str] | None:  # noqa: C901 - one case per node type
        if isinstance(node, pp.VectorSelector):
            have = SCRAPED.get(node.name, set())
            if node.name not in SCRAPED:
                self.problems.append(f"{node.name} is not an exported series")
            self.need({m.name for m in node.matchers.matchers} - {"__name__"}, have, f"selector {node.name}")
            return set(have)
        if isinstance(node, pp.MatrixSelector):
            return self.of(node.vector_selector)
        if isinstance(node, pp.ParenExpr | pp.SubqueryExpr | pp.UnaryExpr):
            return self.of(node.expr)
        if isinstance(node, pp.NumberLiteral | pp.StringLiteral):
            return None
        if isinstance(node, pp.Call):
            return self._call(node)
        if isinstance(node, pp.AggregateExpr):
            have = self.of(node.expr) or set()
            labels = list(node.modifier.labels) if node.modifier else []
            if node.modifier and node.modifier.type == pp.AggModifierType.Without:
                return have - set(labels)
            self.need(labels, have, f"{node.op} by ({', '.join(labels)})")
            return set(labels) if str(node.op) not in ("topk", "bottomk") else have
        if isinstance(node, pp.BinaryExpr):
            left, right = self.of(node.lhs), self.of(node.rhs)
            if left is None or right is None:
                return left if right is None else right
            matching = node.modifier.matching if node.modifier else None
            if matching is not None:
                on = matching.type == pp.LabelModifierType.Include
                self.need(matching.labels, left, f"{node.op} {'on' if on else 'ignoring'}")
                self.need(matching.labels, right, f"{node.op} {'on' if on else 'ignoring'}")
            return left
        raise AssertionError(f"unhandled PromQL node {type(node).__name__}: {node}")

    def _call(self, node) -> set[str] | None:
        name, args = node.func.name, list(node.args)
        values = [self.of(a) for a in args]
        vectors = [v for v in values if v is not None]
        have = vectors[0] if vectors else set()
        if name == "label_replace":
            dst, src = (a.val for a in (args[1], args[3]))
            self.need([src], have, "label_replace source")
            return have | {dst}
        if name == "histogram_quantile":
            self.need(["le"], have, "histogram_quantile")
            return have - {"le"}
        if name in ("vector", "time", "scalar"):
            return set() if name == "vector" else None
        return have


def label_problems(expr: str, templates: list[str]) -> list[str]:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    walker = Labels()
    result = walker.of(pp.parse(expr)) or set()
    used = {m for t in templates for m in re.findall(r"\{\{\s*\$?(?:labels\.)?(\w+)\s*\}\}", t)}
    used |= {m for t in templates for m in re.findall(r"\$labels\.(\w+)", t)}
    walker.need(sorted(used - {"value"}), result, "a legend or annotation template")
    return walker.problems


def queries() -> list[tuple[str, str, list[str]]]:
    """(where, expression, templates naming its labels) of every alert and panel."""
    out = []
    for obj in objects(ALL_ON):
        if obj["kind"] == "PrometheusRule":
            for group in obj["spec"]["groups"]:
                for r in group["rules"]:
                    templates = list(r.get("annotations", {}).values())
                    out.append((f"alert {r['alert']}", r["expr"], templates))
        if obj["kind"] == "ConfigMap":
            for body in obj["data"].values():
                dash = json.loads(body)
                for panel in dash["panels"]:
                    out += [(f"{dash['uid']} panel {panel['title']!r}", t["expr"], [t.get("legendFormat", "")])
                            for t in panel["targets"]]
                out += [(f"{dash['uid']} annotation {a['name']!r}", a["expr"],
                         [a.get("titleFormat", ""), a.get("textFormat", "")])
                        for a in dash["annotations"]["list"] if "expr" in a]
                for var in dash["templating"]["list"]:
                    if var.get("type") == "query":
                        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
                        out.append((f"{dash['uid']} variable {var['name']}", m.group(1), [f"{{{{{m.group(2)}}}}}"]))
    return out


def test_no_metric_label_collides_with_a_target_label():
    """Else the scrape renames it exported_<name> and the series lose their meaning."""
    collisions = {(c.describe()[0].name, label) for c in Metrics().registry._collector_to_names  # noqa: SLF001
                  for label in getattr(c, "_labelnames", ()) if label in TARGET_LABELS}
    assert collisions == set()


def test_operator_series_name_the_inference_deployment():
    labels = scraped_labels()
    for name in ("splitserve_operator_replicas", "splitserve_operator_queue_depth",
                 "splitserve_operator_scale_events_total", "splitserve_operator_reconcile_errors_total"):
        assert {"deployment_namespace", "deployment"} <= labels[name], name


def test_every_query_uses_labels_its_series_have():
    found = queries()
    assert len(found) > 40
    problems = {where: p for where, expr, templates in found if (p := label_problems(expr, templates))}
    assert problems == {}


def test_the_checker_catches_the_old_operator_queries():
    """What the dashboards and alerts did before the rename."""
    assert label_problems('sum by (deployment) (splitserve_operator_replicas{namespace=~"$namespace"})', []) == [
        "selector splitserve_operator_replicas uses label 'namespace', which its input lacks "
        "(['container', 'deployment', 'deployment_namespace', 'endpoint', 'instance', 'job', 'pod', 'role', "
        "'service', 'state'])"]
    assert label_problems("max by (namespace, deployment) (splitserve_operator_replicas) == 0",
                          ["{{ $labels.namespace }}"])[0].startswith("max by (namespace, deployment) uses label "
                                                                     "'namespace'")
    assert label_problems("sum by (role) (splitserve_num_requests_waiting)", ["{{worker}}"]) == [
        "a legend or annotation template uses label 'worker', which its input lacks (['role'])"]
