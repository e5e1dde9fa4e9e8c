"""Scrape targets (ServiceMonitor, PodMonitor), PodDisruptionBudgets, NetworkPolicies."""

from __future__ import annotations

from . import render_common as c
from .render_prefill import WORKER_METRICS_PORT
from .spec import InferenceSpec

OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "splitserve-operator"}


def _monitor_metadata(spec: InferenceSpec, role: str) -> dict:
    """Extra labels first (a Prometheus selects monitors by them, e.g. release), then
    the operator's own, which they may not override."""
    meta = c.metadata(spec, role)
    return {**meta, "labels": {**spec.monitor_labels, **meta["labels"]}}


def render_monitors(spec: InferenceSpec) -> list[dict]:
    out: list[dict] = []
    if spec.service_monitor:
        out.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _monitor_metadata(spec, "router"),
            "spec": {"selector": {"matchLabels": c.selector_labels(spec, "router")},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.scrape_interval}]},
        })
    if spec.pod_monitor:
        out.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": _monitor_metadata(spec, "decode"),
            "spec": {"selector": {"matchLabels": c.selector_labels(spec, "decode")},
                     "podMetricsEndpoints": [{"port": "admin", "path": "/metrics", "interval": spec.scrape_interval}]},
        })
        # Head pods expose the pool driver's metrics, worker pods each actor's; a pod
        # without the named port is simply not scraped on it.
        out.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": _monitor_metadata(spec, "prefill"),
            "spec": {"selector": {"matchLabels": c.selector_labels(spec, "prefill")},
                     "podMetricsEndpoints": [
                         {"port": port, "path": "/metrics", "interval": spec.scrape_interval}
                         for port in ("pool-metrics", "actor-metrics")]},
        })
    return out


def _pdb(spec: InferenceSpec, role: str, selector: dict) -> dict:
    # maxUnavailable (not minAvailable) so a one-replica role can still be drained off a node.
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": c.metadata(spec, role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}


def render_pdbs(spec: InferenceSpec) -> list[dict]:
    return [
        _pdb(spec, "router", c.selector_labels(spec, "router")),
        _pdb(spec, "decode", c.selector_labels(spec, "decode")),
        _pdb(spec, "prefill", {**c.selector_labels(spec, "prefill"), "splitserve.io/ray-node": "worker"}),
    ]


def _port(number: int) -> dict:
    return {"protocol": "TCP", "port": number}


def _netpol(spec: InferenceSpec, role: str, ingress: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": c.metadata(spec, role),
            "spec": {"podSelector": {"matchLabels": c.selector_labels(spec, role)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def render_network_policies(spec: InferenceSpec) -> list[dict]:
    """Ingress only: clients reach the router; workers, Ray and Redis accept traffic
    from this deployment's own pods (gRPC, KV transfer, Ray's many ports); metrics
    ports are open to any scraper; the operator reads load reports from Redis."""
    if not spec.network_policy:
        return []
    same_deployment = {"podSelector": {"matchLabels": {"splitserve.io/deployment": spec.name}}}
    out = [
        _netpol(spec, "router", [{"ports": [_port(c.ROUTER_PORT)]}]),
        _netpol(spec, "decode", [{"from": [same_deployment]}, {"ports": [_port(c.ADMIN_PORT)]}]),
        _netpol(spec, "prefill", [{"from": [same_deployment]},
                                  {"ports": [_port(c.ADMIN_PORT), _port(WORKER_METRICS_PORT)]}]),
    ]
    if not spec.external_redis:
        operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
        out.append(_netpol(spec, "redis", [{"from": [same_deployment, operator], "ports": [_port(c.REDIS_PORT)]}]))
    return out
