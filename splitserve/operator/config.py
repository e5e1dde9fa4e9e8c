"""Operator settings, read from the environment (the chart sets them; `splitserve
operator` flags set the same variables before the handlers module is imported,
because it reads its configuration once, at import)."""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass, field

from .labels import label_problems


def _installed_ray_version() -> str:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return "2.40.0"


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 15.0  # drift correction, status and autoscaling tick
    default_image: str = "ghcr.io/splitserve/splitserve:0.1.0"  # when a spec names no image
    ray_version: str = ""  # RayCluster.spec.rayVersion; must match Ray inside the image
    metrics_port: int = 8080  # 0 disables the operator's /metrics
    post_events: bool = True  # Kubernetes events for handler progress
    # Extra labels on every ServiceMonitor/PodMonitor the operator creates, e.g.
    # {"release": "kube-prometheus-stack"}, which that stack selects monitors by.
    monitor_labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> OperatorConfig:
        e = os.environ
        try:
            return cls(
                resync_seconds=float(e.get("SPLITSERVE_OPERATOR_RESYNC_SECONDS", cls.resync_seconds)),
                default_image=e.get("SPLITSERVE_OPERATOR_IMAGE", cls.default_image),
                ray_version=e.get("SPLITSERVE_RAY_VERSION") or _installed_ray_version(),
                metrics_port=int(e.get("SPLITSERVE_OPERATOR_METRICS_PORT", cls.metrics_port)),
                post_events=e.get("SPLITSERVE_OPERATOR_POST_EVENTS", "true").lower() in ("1", "true", "yes"),
                monitor_labels=monitor_labels(e.get("SPLITSERVE_OPERATOR_MONITOR_LABELS", "{}")),
            )
        except ValueError as exc:
            raise SystemExit(f"splitserve operator: bad SPLITSERVE_OPERATOR_* setting: {exc}") from exc


def monitor_labels(text: str) -> dict[str, str]:
    """SPLITSERVE_OPERATOR_MONITOR_LABELS: a JSON object of label -> value."""
    labels = json.loads(text)
    if not isinstance(labels, dict):
        raise ValueError(f"SPLITSERVE_OPERATOR_MONITOR_LABELS must be a JSON object, got {text!r}")
    problems = label_problems(labels, "--monitor-label")
    if problems:
        raise ValueError("; ".join(problems))
    return labels
