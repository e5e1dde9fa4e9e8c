"""Every PromQL expression in the chart's alerts and dashboards queries only metric
names the code exports (splitserve.metrics.exported_metric_names), and every alert
has a runbook entry in docs/operations.md.

Expressions are parsed with promql-parser (Prometheus' grammar, Rust bindings) when
installed; a small tokenizer is the fallback and must agree with it."""

from __future__ import annotations

import json
import re

import pytest

from splitserve.metrics import exported_metric_names

from .test_chart import ALL_ON, REPO, objects

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "atan2", "start", "end"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def _substitute(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def names_by_tokenizer(expr: str) -> set[str]:
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", _substitute(expr))  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", s):
        name, call = m.group(1), m.group(2)
        if not call and name.lower() not in KEYWORDS:
            names.add(name)
    return names


def names_by_parser(expr: str) -> set[str] | None:
    try:
        import promql_parser
    except ImportError:
        return None
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True
    promql_parser.walk(promql_parser.parse(_substitute(expr)), visit)
    return names


def metric_names(expr: str) -> set[str]:
    by_tokens = names_by_tokenizer(expr)
    by_parser = names_by_parser(expr)
    if by_parser is not None:
        assert by_parser == by_tokens, f"tokenizer and parser disagree on {expr!r}"
    return by_tokens


def expressions() -> list[tuple[str, str]]:
    out = []
    for obj in objects(ALL_ON):
        if obj["kind"] == "PrometheusRule":
            for group in obj["spec"]["groups"]:
                out += [(f"alert {r['alert']}", r["expr"]) for r in group["rules"]]
        if obj["kind"] == "ConfigMap":
            for body in obj["data"].values():
                dash = json.loads(body)
                for panel in dash["panels"]:
                    out += [(f"{dash['uid']} panel {panel['title']!r}", t["expr"]) for t in panel["targets"]]
                out += [(f"{dash['uid']} annotation {a['name']!r}", a["expr"])
                        for a in dash["annotations"]["list"] if "expr" in a]
                for var in dash["templating"]["list"]:
                    if var.get("type") == "query":
                        inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"]).group(1)
                        out.append((f"{dash['uid']} variable {var['name']}", inner))
    return out


def test_extractor_finds_names_and_ignores_labels_functions_keywords():
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{role="decode",x=~"by|on"}[5m])))'
            " > 2 and on(namespace) b unless ignoring(x) c offset 5m or vector(1) / max_over_time(d[10m:1m])")
    assert metric_names(expr) == {"a_bucket", "b", "c", "d"}


def test_every_expression_uses_exported_metrics():
    exported = exported_metric_names()
    found = expressions()
    assert len(found) > 40
    unknown = {(where, name) for where, expr in found for name in metric_names(expr) if name not in exported}
    assert unknown == set(), "queries reference metrics no code exports"


def test_an_unexported_metric_would_be_caught():
    assert "splitserve_gpu_temperature" not in exported_metric_names()
    assert metric_names("max(splitserve_gpu_temperature) > 80") == {"splitserve_gpu_temperature"}


def test_the_required_alerts_exist_with_runbooks():
    alerts = {where.removeprefix("alert "): expr for where, expr in expressions() if where.startswith("alert ")}
    required = {
        "SplitserveTTFTP99High": "splitserve_time_to_first_token_seconds_bucket",
        "SplitserveITLP99High": "splitserve_inter_token_latency_seconds_bucket",
        "SplitserveQueueGrowing": "splitserve_num_requests_waiting",
        "SplitserveKVCacheNearlyFull": "splitserve_kv_cache_usage_perc",
        "SplitserveNoReadyDecodeWorkers": "splitserve_operator_replicas",
        "SplitserveKVTransferErrors": "splitserve_kv_transfer_errors_total",
        "SplitserveRouterIndexGaps": "splitserve_router_index_resyncs_total",
    }
    for alert, metric in required.items():
        assert metric in metric_names(alerts[alert]), alert
    assert "> 1.5" in alerts["SplitserveTTFTP99High"]  # the threshold value comes from values.yaml
    assert "> 0.9" in alerts["SplitserveKVCacheNearlyFull"]
    operations = (REPO / "docs/operations.md").read_text()
    headings = set(re.findall(r"^### (\w+)", operations, flags=re.M))
    missing = set(alerts) - headings
    assert not missing, f"alerts without a runbook entry in docs/operations.md: {missing}"


@pytest.mark.parametrize("where,expr", expressions())
def test_expressions_parse(where, expr):
    if names_by_parser(expr) is None:
        pytest.skip("promql-parser not installed; the tokenizer alone checked the names")
