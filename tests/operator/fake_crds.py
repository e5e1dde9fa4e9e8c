"""CustomResourceDefinitions in the fake API server, as kube-apiserver serves them: a
created CRD is checked (crd_rules.py) and refused with the real message, an accepted
one serves its kind, and that kind's objects are pruned, defaulted and validated on
every write (crd_values.py)."""

from __future__ import annotations

from .crd_rules import crd_errors, rejection
from .crd_values import admit
from .fake_lifecycle import CRDS


class ApiError(Exception):
    """A refused request: HTTP status, Status reason, message (as kube-apiserver's)."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class CustomResources:
    """Mixed into FakeKube: uses its kinds, schemas and cluster_scoped."""

    kinds: dict[tuple[str, str], str]
    schemas: dict[tuple[str, str], dict]
    cluster_scoped: set[tuple[str, str]]

    def crd_resources(self, crd: dict) -> set[tuple[str, str]]:
        spec = crd["spec"]
        return {(f"{spec['group']}/{v['name']}", spec["names"]["plural"]) for v in spec["versions"] if v.get("served")}

    def _register_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        for v in spec["versions"]:
            if v.get("served"):
                resource = (f"{spec['group']}/{v['name']}", spec["names"]["plural"])
                self.kinds[resource] = spec["names"]["kind"]
                self.schemas[resource] = v["schema"]["openAPIV3Schema"]
                if spec.get("scope") == "Cluster":
                    self.cluster_scoped.add(resource)

    def unregister_crd(self, crd: dict) -> None:
        for resource in self.crd_resources(crd):
            self.kinds.pop(resource, None)
            self.schemas.pop(resource, None)

    def _admit(self, gv: str, plural: str, obj: dict) -> dict:
        """A custom resource as the API server stores it: pruned, defaulted, valid."""
        if (gv, plural) == CRDS:
            errors = crd_errors(obj)
            if errors:
                raise ApiError(422, "Invalid", rejection(obj, errors))
            return obj
        schema = self.schemas.get((gv, plural))
        if schema is None:
            return obj
        obj, errors = admit(schema, obj)
        if errors:
            group = gv.split("/")[0]
            shown = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            raise ApiError(422, "Invalid", f'{self.kinds[(gv, plural)]}.{group} "{obj["metadata"]["name"]}" '
                                           f"is invalid: {shown}")
        return obj
