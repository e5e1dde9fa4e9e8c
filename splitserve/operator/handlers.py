"""kopf handlers for InferenceDeployment. Every path runs the same reconcile:
parse/validate the spec, render the children, sync them, observe, write status.
The resync loop (resync.py) adds autoscaling and is also what corrects drift (a
deleted or edited child comes back within one resync interval).

No finalizer, ever: kopf adds one for timers, daemons and mandatory delete handlers
and removes it only while running, so an uninstalled operator would leave objects
Terminating. Nothing needs one: children carry owner references and are
garbage-collected, and a deleted object's metric series go when its DELETED event
arrives (if the operator is down then, its series went with the process).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import replace

import kopf
from prometheus_client import start_http_server

from splitserve.metrics import Metrics

from .apply import sync_children
from .autoscaler import ScalingPolicy, Windows, decide
from .cluster_token import TokenUnavailable, ensure_token_secret
from .config import OperatorConfig
from .kube import KubeClient
from .loadreports import LoadReportsUnavailable, read_load_reports, redis_url
from .render import Replicas, key, render_all, unwanted_children
from .resync import Tracked, resync_forever, track
from .spec import GROUP, PLURAL, VERSION, InferenceSpec, SpecError, parse_spec
from .status import conditions, observe_deployment, observe_raycluster, status_patch

CONFIG = OperatorConfig.from_env()
METRICS = Metrics()
_client: KubeClient | None = None
log = logging.getLogger(__name__)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.index(GROUP, VERSION, PLURAL)
def inference_deployments(namespace, name, body, memo, **_) -> dict[tuple[str, str], Tracked]:
    """What the resync loop walks: every watched object, kept current by kopf's watch."""
    return {(namespace, name): track(body, memo)}


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, inference_deployments: kopf.Index, **_):
    # Keep kopf's bookkeeping in our own annotations (the status schema is strict).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # The finalizer earlier versions had kopf add (for their timer): kopf removes
    # it from every object it sees, since no handler here requires one.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.posting.enabled = CONFIG.post_events
    if CONFIG.metrics_port:
        start_http_server(CONFIG.metrics_port, registry=METRICS.registry)
    memo["resync"] = asyncio.create_task(resync_forever(
        inference_deployments, CONFIG.resync_seconds,
        lambda body, patch, obj_memo, logger: reconcile(body, patch, obj_memo, logger, scale=True), write_status))


async def write_status(body: dict, status: dict) -> None:
    meta = body["metadata"]
    if _client is not None:
        await _client.patch_status(body["apiVersion"], body["kind"], meta["namespace"], meta["name"], status)


@kopf.on.login()
def login(**kwargs):
    """In-cluster ServiceAccount first, else $KUBECONFIG / ~/.kube/config. The same
    credentials serve kopf's watches and our child writes."""
    global _client
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        _client = KubeClient(info)
    return info


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_):
    if "resync" in memo:
        memo["resync"].cancel()
    if _client is not None:
        await _client.close()


def scheduled_replicas(spec: InferenceSpec, status: dict) -> Replicas:
    """The spec's replicas, or with autoscaling on, the last decision kept in status
    (so an operator restart does not reset scaling), clamped to the current bounds."""
    def pick(role: str) -> int:
        rs = getattr(spec, role)
        value = (status.get(role) or {}).get("desired") if spec.autoscaling.enabled else None
        value = value if isinstance(value, int) and not isinstance(value, bool) else rs.replicas
        return min(max(value, rs.min_replicas), rs.max_replicas)
    return Replicas(prefill=pick("prefill"), decode=pick("decode"))


async def autoscale(spec: InferenceSpec, replicas: Replicas, memo: kopf.Memo, patch: kopf.Patch,
                    logger: logging.Logger) -> tuple[Replicas, dict[str, int | None]]:
    windows: dict[str, Windows] = memo.setdefault("windows", {})
    try:
        reports = await read_load_reports(await redis_url(_client, spec), spec.cluster)
        unavailable = None
    except LoadReportsUnavailable as exc:
        reports, unavailable = [], str(exc)
    now, new, queue, reasons = time.time(), {}, {}, {}
    for role in ("prefill", "decode"):
        current = getattr(replicas, role)
        policy = ScalingPolicy.for_role(getattr(spec, role), spec.autoscaling)
        d = decide(policy, current, [r for r in reports if r.role == role], now, windows.get(role, Windows()))
        if unavailable:
            d = type(d)(d.replicas, Windows(), f"{unavailable}: holding at {d.replicas}")
        windows[role], new[role], queue[role], reasons[role] = d.windows, d.replicas, d.waiting, d.reason
        labels = (spec.namespace, spec.name, role)
        if d.waiting is not None:
            METRICS.operator_queue_depth.labels(*labels).set(d.waiting)
        if d.changed(current):
            direction = "up" if d.replicas > current else "down"
            METRICS.operator_scale_events.labels(*labels, direction).inc()
            patch.status["lastScaleTime"] = _now()
            logger.info(f"autoscaler {spec.cluster} {role}: {d.reason}")
    patch.status["autoscaler"] = reasons
    return Replicas(**new), queue


async def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                    scale: bool) -> None:
    # The resync and a change handler can fire together for one object; one at a time.
    async with memo.setdefault("lock", asyncio.Lock()):
        if memo.get("deleted"):
            return  # a resync holding the body from before its DELETED event
        await _reconcile(body, patch, memo, logger, scale)


async def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                     scale: bool) -> None:
    meta, status = body["metadata"], dict(body.get("status") or {})
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation", 0)
    previous = status.get("conditions") or []
    try:
        spec = parse_spec(name, namespace, dict(body.get("spec") or {}), CONFIG.default_image)
        spec = replace(spec, monitor_labels={**CONFIG.monitor_labels, **spec.monitor_labels})
    except SpecError as exc:
        METRICS.operator_reconcile_errors.labels(namespace, name).inc()
        message = f"invalid spec, nothing applied until fixed: {exc}"
        logger.error(f"InferenceDeployment {namespace}/{name}: {message}")
        patch.status["conditions"] = conditions({}, ("InvalidSpec", message), previous, _now(), generation)
        patch.status["observedGeneration"] = generation
        return
    if _client is None:
        raise kopf.TemporaryError("no Kubernetes credentials yet (login pending)", delay=5)
    owner = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": meta}
    try:  # before any pod: a pod without its token Secret would not start
        spec = replace(spec, cluster_token_hash=await ensure_token_secret(_client, owner, spec))
    except TokenUnavailable as exc:
        METRICS.operator_reconcile_errors.labels(namespace, name).inc()
        logger.error(f"InferenceDeployment {namespace}/{name}: {exc}")
        patch.status["conditions"] = conditions({}, ("ClusterTokenUnavailable", str(exc)), previous, _now(),
                                                generation)
        return
    replicas = scheduled_replicas(spec, status)
    queue: dict[str, int | None] = {}
    if scale and spec.autoscaling.enabled:
        replicas, queue = await autoscale(spec, replicas, memo, patch, logger)
    manifests = render_all(spec, replicas, CONFIG.ray_version)
    result = await sync_children(_client, owner, manifests, unwanted_children(spec, CONFIG.ray_version))
    for verb, items in (("created", result.created), ("re-applied (drift)", result.patched),
                        ("deleted", result.deleted)):
        if items:
            logger.info(f"InferenceDeployment {namespace}/{name}: {verb} {', '.join(items)}")
    observed = {k: result.observed.get(k) for k in map(key, manifests)}
    roles = {
        "router": observe_deployment(observed.get(("apps/v1", "Deployment", f"{name}-router")),
                                     spec.router.replicas),
        "prefill": observe_raycluster(observed.get(("ray.io/v1", "RayCluster", f"{name}-prefill")),
                                      replicas.prefill),
        "decode": observe_deployment(observed.get(("apps/v1", "Deployment", f"{name}-decode")), replicas.decode),
    }
    problem = None
    if result.errors:
        METRICS.operator_reconcile_errors.labels(namespace, name).inc()
        problem = ("ApplyFailed", "; ".join(result.errors))
        logger.error(f"InferenceDeployment {namespace}/{name}: {problem[1]}")
    conds = conditions(roles, problem, previous, _now(), generation)
    patch.status.update(status_patch(roles, conds, generation, queue))
    for role, o in roles.items():
        METRICS.operator_replicas.labels(namespace, name, role, "desired").set(o.desired)
        METRICS.operator_replicas.labels(namespace, name, role, "ready").set(o.ready)


@kopf.on.create(GROUP, VERSION, PLURAL)
async def on_create(body, patch, memo, logger, **_):
    await reconcile(body, patch, memo, logger, scale=False)


@kopf.on.update(GROUP, VERSION, PLURAL)
async def on_update(body, patch, memo, logger, **_):
    await reconcile(body, patch, memo, logger, scale=False)


@kopf.on.resume(GROUP, VERSION, PLURAL)
async def on_resume(body, patch, memo, logger, **_):
    await reconcile(body, patch, memo, logger, scale=False)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def forget_deleted(type, name, namespace, memo, logger, **_):  # noqa: A002 - kopf's argument name
    """Children go with the owner (garbage collection via owner references); only
    this process's metric series need forgetting, after any reconcile in flight (which
    sets them), and for good (a later resync of the old body is skipped)."""
    if type != "DELETED":
        return
    async with memo.setdefault("lock", asyncio.Lock()):
        memo["deleted"] = True
    for metric in (METRICS.operator_replicas, METRICS.operator_queue_depth, METRICS.operator_scale_events,
                   METRICS.operator_reconcile_errors):
        for labels in [ls for ls in list(metric._metrics) if ls[:2] == (namespace, name)]:  # noqa: SLF001
            metric.remove(*labels)
    logger.info(f"InferenceDeployment {namespace}/{name} deleted; children are garbage-collected by Kubernetes")
