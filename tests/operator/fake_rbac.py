"""RBAC for the fake API server: a request is allowed when one of the identity's
PolicyRules (from the chart's ClusterRoles) grants its verb on its resource, as the
RBAC authorizer decides; plus the OwnerReferencesPermissionEnforcement admission
plugin, which real clusters often enable: setting ownerReferences needs `delete` on
the object, and `blockOwnerDeletion: true` needs `update` on the owner's
`<plural>/finalizers`. Messages follow kube-apiserver's.
"""

from __future__ import annotations

from dataclasses import dataclass

USER = "system:serviceaccount:splitserve-system:ss-splitserve"


@dataclass(frozen=True)
class Attributes:
    verb: str
    group: str
    resource: str  # "inferencedeployments" or "inferencedeployments/status"
    namespace: str | None
    name: str | None


def attributes(method: str, gv: str, plural: str, sub: str | None, ns: str | None, name: str | None,
               watch: bool) -> Attributes:
    if method == "GET":
        verb = "get" if name else ("watch" if watch else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update",
                "DELETE": "delete" if name else "deletecollection"}[method]
    group = gv.split("/")[0] if "/" in gv else ""
    return Attributes(verb, group, f"{plural}/{sub}" if sub else plural, ns, name)


def allowed(rules: list[dict], a: Attributes) -> bool:
    def has(values, wanted):
        return "*" in values or wanted in values
    return any(has(r.get("verbs", []), a.verb) and has(r.get("apiGroups", []), a.group)
               and has(r.get("resources", []), a.resource)
               and (not r.get("resourceNames") or a.name in r["resourceNames"]) for r in rules)


def denial(a: Attributes) -> str:
    what = f'{a.resource.split("/")[0]}{"." + a.group if a.group else ""}'
    target = f'"{a.name}" ' if a.name else ""
    where = f' in the namespace "{a.namespace}"' if a.namespace else " at the cluster scope"
    return (f'{what} {target}is forbidden: User "{USER}" cannot {a.verb} resource "{a.resource}" '
            f'in API group "{a.group}"{where}')


def owner_reference_denial(rules: list[dict], plurals: dict[tuple[str, str], str], a: Attributes,
                           old: dict | None, new: dict) -> str | None:
    """OwnerReferencesPermissionEnforcement for a create or update `a` of `new`."""
    def refs(obj):
        return {r.get("uid"): r for r in (obj or {}).get("metadata", {}).get("ownerReferences") or []}
    before, after = refs(old), refs(new)
    if before == after:
        return None
    what = f'{a.resource.split("/")[0]}{"." + a.group if a.group else ""} "{new["metadata"].get("name")}"'
    delete = Attributes("delete", a.group, a.resource.split("/")[0], a.namespace, a.name)
    if not allowed(rules, delete):
        return f"{what} is forbidden: cannot set an ownerRef on a resource you can't delete: {denial(delete)}"
    for uid, ref in after.items():
        if ref.get("blockOwnerDeletion") and not before.get(uid, {}).get("blockOwnerDeletion"):
            plural = plurals.get((ref["apiVersion"], ref["kind"]))
            group = ref["apiVersion"].split("/")[0] if "/" in ref["apiVersion"] else ""
            update = Attributes("update", group, f"{plural}/finalizers", a.namespace, ref.get("name"))
            if plural is None or not allowed(rules, update):
                return (f"{what} is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to a "
                        f"resource you can't set finalizers on: {denial(update)}")
    return None
