"""`splitserve operator`: run the kopf operator for InferenceDeployments."""

from __future__ import annotations

import argparse
import json
import logging
import os

from splitserve.core.cli_types import OneLineParser

from .labels import label_problems


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="splitserve operator",
                      description="Reconcile InferenceDeployments into router, prefill and decode.")
    p.add_argument("--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--resync-seconds", type=float, default=None,
                   help="drift correction / status / autoscaling interval (default 15)")
    p.add_argument("--metrics-port", type=int, default=None, help="operator /metrics port, 0 = off (default 8080)")
    p.add_argument("--image", default=None, help="splitserve image for specs that name none")
    p.add_argument("--ray-version", default=None, help="rayVersion written into RayClusters")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint URL")
    p.add_argument("--no-events", action="store_true", help="do not post Kubernetes events")
    p.add_argument("--monitor-label", action="append", default=[], metavar="KEY=VALUE",
                   help="label for every ServiceMonitor/PodMonitor the operator creates (repeatable), "
                        "e.g. release=kube-prometheus-stack")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.resync_seconds is not None and args.resync_seconds <= 0:
        p.error("--resync-seconds must be > 0")
    labels = dict(item.partition("=")[::2] for item in args.monitor_label)
    problems = ([f"--monitor-label {item!r} is not KEY=VALUE" for item in args.monitor_label if "=" not in item]
                or label_problems(labels, "--monitor-label"))
    if problems:
        p.error("; ".join(problems))
    args.monitor_labels = labels
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # Settings travel as env vars: handlers.py reads them when imported, so they must
    # be in place before that import.
    for var, value in (("SPLITSERVE_OPERATOR_RESYNC_SECONDS", args.resync_seconds),
                       ("SPLITSERVE_OPERATOR_METRICS_PORT", args.metrics_port),
                       ("SPLITSERVE_OPERATOR_IMAGE", args.image), ("SPLITSERVE_RAY_VERSION", args.ray_version)):
        if value is not None:
            os.environ[var] = str(value)
    if args.no_events:
        os.environ["SPLITSERVE_OPERATOR_POST_EVENTS"] = "false"
    if args.monitor_labels:
        os.environ["SPLITSERVE_OPERATOR_MONITOR_LABELS"] = json.dumps(args.monitor_labels)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf

    from . import handlers  # noqa: F401 - registers the handlers with kopf

    # standalone: one operator replica (the chart runs one, Recreate strategy); kopf
    # peering would need its own cluster-wide CRD.
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=args.liveness or None)
    return 0
