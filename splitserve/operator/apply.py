"""Bring children in line with the rendered manifests: create the missing, re-apply
the drifted, delete the unwanted. Comparison is pure (`drifted`); writes happen
only when something differs, so a steady cluster costs one GET per child per tick.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kube import ApiError, KubeClient
from .render_common import adopt


def _same_scalar(a, b) -> bool:
    # The API server may return 1 where we sent "1" (quantities, ports); compare text.
    return a == b or (not isinstance(a, dict | list) and not isinstance(b, dict | list) and str(a) == str(b))


def drifted(desired, live) -> bool:
    """True if `live` does not contain `desired`. Fields the API server or other
    controllers add (defaults, status, annotations) are not drift; lists must match
    element by element because we render them whole."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return True
        return any(drifted(v, live.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return True
        return any(drifted(d, v) for d, v in zip(desired, live, strict=True))
    return not _same_scalar(desired, live)


def controller_uid(obj: dict) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


@dataclass
class SyncResult:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per child, says what to do
    observed: dict[tuple[str, str, str], dict] = field(default_factory=dict)  # key -> live object


def explain(exc: ApiError, kind: str, name: str) -> str:
    if exc.status == 404:
        return (f"{kind} {name}: the API server does not serve {kind} ({exc.path}); install its CRD "
                "(KubeRay for RayCluster, prometheus-operator for ServiceMonitor/PodMonitor) or turn it off")
    if exc.status == 403:
        return (f"{kind} {name}: forbidden ({exc.method}); the operator's RBAC lacks this verb, "
                "check the chart's ClusterRole")
    return f"{kind} {name}: {exc.method} failed with HTTP {exc.status}: {exc.message}"


async def sync_children(client: KubeClient, owner: dict, manifests: list[dict],
                        unwanted: list[tuple[str, str, str]]) -> SyncResult:
    result = SyncResult()
    uid = owner["metadata"]["uid"]
    for manifest in manifests:
        desired = adopt(manifest, owner)
        api, kind, name, ns = manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"], \
            manifest["metadata"]["namespace"]
        try:
            live = await client.get(api, kind, ns, name)
            if live is not None and controller_uid(live) not in (None, uid):
                result.errors.append(f"{kind} {name} exists and is controlled by another owner "
                                     f"(uid {controller_uid(live)}); rename or delete it")
                continue
            if live is None:
                live = await client.apply(desired)
                result.created.append(f"{kind}/{name}")
            elif drifted(desired, live):
                live = await client.apply(desired)
                result.patched.append(f"{kind}/{name}")
            result.observed[(api, kind, name)] = live
        except ApiError as exc:
            result.errors.append(explain(exc, kind, name))
    for api, kind, name in unwanted:
        try:
            live = await client.get(api, kind, owner["metadata"]["namespace"], name)
            if live is not None and controller_uid(live) == uid:
                await client.delete(api, kind, owner["metadata"]["namespace"], name)
                result.deleted.append(f"{kind}/{name}")
        except ApiError as exc:
            if exc.status != 404:  # kind not served at all: nothing to delete
                result.errors.append(explain(exc, kind, name))
    return result
