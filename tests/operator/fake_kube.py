"""A FAKE Kubernetes API server (aiohttp on 127.0.0.1) for running the operator's
kopf handlers in tests. No real API server can run on the test machines, so this one
is as strict as kube-apiserver where the operator's correctness depends on it.

It implements what kopf and the operator call: discovery (/api, /apis, group
versions), list + watch (JSON-lines events, resourceVersion), get, create,
merge-patch, JSON patch, a simplified server-side apply (create-or-deep-merge; unlike
the real one it does not remove fields the manager stopped sending), the status
subresource, and delete. Beyond that, as the real server:
- CustomResourceDefinitions (fake_crds.py): a created CRD is checked as
  kube-apiserver checks it (crd_rules.py: structural schema, defaults against the
  schema and CEL rules) and rejected with its message; an accepted one serves its
  kind, whose objects are pruned, defaulted and validated (OpenAPI and CEL) on every
  write (crd_values.py);
- deletion with finalizers, propagation policies, garbage collection, Terminating
  namespaces and CRD cleanup (fake_lifecycle.py);
- RBAC, when given the identity's rules, with OwnerReferencesPermissionEnforcement
  (fake_rbac.py).
No controllers besides those: tests set children's status themselves (e.g.
readyReplicas) to play the controllers' part.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid

from aiohttp import web

from .fake_crds import ApiError, CustomResources
from .fake_lifecycle import CRDS, NAMESPACES, Lifecycle, now
from .fake_patch import PatchConflict, json_patch, merge
from .fake_rbac import allowed, attributes, denial, owner_reference_denial

PATH = re.compile(r"^/(?P<gv>api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
                  r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$")


class FakeKube(CustomResources, Lifecycle):
    def __init__(self, kinds: dict[tuple[str, str], str], rbac_rules: list[dict] | None = None):
        """kinds: (apiVersion like 'apps/v1' or 'v1', plural) -> Kind, served without a
        schema; CRDs created later add theirs. rbac_rules: the PolicyRules every request
        is authorized against (None: no authorization)."""
        self.kinds = kinds
        self.schemas: dict[tuple[str, str], dict] = {}  # (gv, plural) -> openAPIV3Schema, from CRDs
        self.cluster_scoped = {NAMESPACES, CRDS}
        self.rbac_rules = rbac_rules
        self.denied: list[str] = []  # messages of refused requests (RBAC, admission)
        self.objects: dict[tuple[str, str, str | None, str], dict] = {}  # (gv, plural, ns, name)
        self.events: list[tuple[int, str, str, str, dict]] = []  # (rv, gv, plural, type, obj)
        self.rv = 1
        self.changed = asyncio.Condition()
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.closing = False
        self.kinds[NAMESPACES] = "Namespace"  # kopf lists/watches namespaces
        self.kinds[CRDS] = "CustomResourceDefinition"
        self._settle_lock = asyncio.Lock()

    # -- server ----------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self.closing = True  # ends open watch streams
        async with self.changed:
            self.changed.notify_all()
        if self._runner:
            await self._runner.cleanup()

    # -- helpers for tests -----------------------------------------------------
    def get(self, gv: str, plural: str, ns: str | None, name: str) -> dict | None:
        obj = self.objects.get((gv, plural, ns, name))
        return copy.deepcopy(obj) if obj else None

    def list(self, gv: str, plural: str, ns: str | None) -> list[dict]:
        return [copy.deepcopy(o) for (g, p, n, _), o in self.objects.items() if (g, p, n) == (gv, plural, ns)]

    async def create_namespace(self, name: str) -> dict:
        return await self._create("v1", "namespaces", None, {"metadata": {"name": name}})

    async def create(self, gv: str, plural: str, ns: str | None, body: dict) -> dict:
        """Create as a user would (kubectl create); raises ApiError if refused."""
        return await self._create(gv, plural, ns, body)

    async def patch_spec(self, gv: str, plural: str, ns: str, name: str, patch: dict) -> dict:
        """Merge-patch as a user would (kubectl patch --type merge)."""
        obj = self.objects[(gv, plural, ns, name)]
        return await self._update(gv, plural, ns, name, merge(obj, patch))

    async def set_status(self, gv: str, plural: str, ns: str, name: str, status: dict) -> None:
        """Play a controller: write a child's status (e.g. readyReplicas)."""
        obj = self.objects[(gv, plural, ns, name)]
        await self._store(gv, plural, ns, name, {**obj, "status": status}, "MODIFIED")

    async def remove(self, gv: str, plural: str, ns: str | None, name: str, propagation: str = "Background") -> dict:
        """Delete as a user would (kubectl delete [--cascade=foreground|orphan])."""
        return await self._delete(gv, plural, ns, name, propagation)

    def _check_owner_refs(self, gv, plural, ns, old: dict | None, new: dict) -> None:
        if self.rbac_rules is None:
            return
        plurals = {(g, kind): p for (g, p), kind in self.kinds.items()}
        a = attributes("PATCH" if old else "POST", gv, plural, None, ns, new["metadata"].get("name"), False)
        message = owner_reference_denial(self.rbac_rules, plurals, a, old, new)
        if message:
            self.denied.append(message)
            raise ApiError(403, "Forbidden", message)

    # -- storage ---------------------------------------------------------------
    async def _store(self, gv, plural, ns, name, obj, event_type) -> dict:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if event_type == "DELETED":
            self.objects.pop((gv, plural, ns, name), None)
        else:
            self.objects[(gv, plural, ns, name)] = obj
        self.events.append((self.rv, gv, plural, event_type, copy.deepcopy(obj)))
        async with self.changed:
            self.changed.notify_all()
        return copy.deepcopy(obj)

    async def _create(self, gv, plural, ns, body) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if (gv, plural, ns, meta.get("name")) in self.objects:
            raise ApiError(409, "AlreadyExists", f'{plural} "{meta.get("name")}" already exists')
        namespace = self.objects.get(("v1", "namespaces", None, ns)) if ns else None
        if namespace and namespace["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", f'{plural} "{meta.get("name")}" is forbidden: unable to create new '
                                             f"content in namespace {ns} because it is being terminated")
        if ns:
            meta["namespace"] = ns
        obj.setdefault("apiVersion", gv)
        obj.setdefault("kind", self.kinds[(gv, plural)])
        obj = self._admit(gv, plural, obj)
        self._check_owner_refs(gv, plural, ns, None, obj)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=now())
        created = await self._store(gv, plural, ns, meta["name"], obj, "ADDED")
        if (gv, plural) == CRDS:
            self._register_crd(obj)
        await self._settle()  # an object whose owners are gone is collected at once
        return created

    async def _update(self, gv, plural, ns, name, new) -> dict:
        old = self.objects[(gv, plural, ns, name)]
        if old["metadata"].get("deletionTimestamp"):
            added = sorted(set(new["metadata"].get("finalizers") or []) - set(old["metadata"].get("finalizers") or []))
            if added:
                raise ApiError(422, "Invalid", f'{plural} "{name}" is invalid: metadata.finalizers: Forbidden: no new '
                                               f"finalizers can be added if the object is being deleted, found new "
                                               f"finalizers {added}")
        new = self._admit(gv, plural, new)
        self._check_owner_refs(gv, plural, ns, old, new)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        gone = new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers") \
            and (gv, plural) != NAMESPACES
        result = await self._store(gv, plural, ns, name, new, "DELETED" if gone else "MODIFIED")
        await self._settle()
        return result

    # -- HTTP ------------------------------------------------------------------
    @staticmethod
    def _gv(gv: str) -> str:
        return "v1" if gv == "api/v1" else gv.removeprefix("apis/")

    def _discovery(self, path: str) -> dict | None:
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups = sorted({gv.split("/")[0] for gv, _ in self.kinds if "/" in gv})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": gv, "version": gv.split("/")[1]}
                                         for gv, _ in self.kinds if gv.startswith(g + "/")][:1],
                 "preferredVersion": next({"groupVersion": gv, "version": gv.split("/")[1]}
                                          for gv, _ in self.kinds if gv.startswith(g + "/"))} for g in groups]}
        gv = path.removeprefix("/api/").removeprefix("/apis/")
        resources = []
        for (g, plural), kind in self.kinds.items():
            if g == gv:
                verbs = ["get", "list", "watch", "create", "patch", "update", "delete"]
                namespaced = (g, plural) not in self.cluster_scoped
                resources.append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced,
                                  "kind": kind, "verbs": verbs})
                resources.append({"name": f"{plural}/status", "singularName": "", "namespaced": namespaced,
                                  "kind": kind, "verbs": ["get", "patch", "update"]})
        if not resources:
            return None
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    @staticmethod
    def _error(status: int, message: str, reason: str = "") -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                  "reason": reason, "code": status}, status=status)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.requests.append((request.method, path))
        m = PATH.match(path)
        if m is None:
            found = self._discovery(path) if request.method == "GET" else None
            return web.json_response(found) if found else self._error(404, f"{path} not found", "NotFound")
        gv, ns, plural, name, sub = self._gv(m["gv"]), m["ns"], m["plural"], m["name"], m["sub"]
        if (gv, plural) not in self.kinds:
            return self._error(404, f"the server could not find the requested resource ({path})", "NotFound")
        if self.rbac_rules is not None:
            a = attributes(request.method, gv, plural, sub, ns, name, request.query.get("watch") in ("true", "1"))
            if not allowed(self.rbac_rules, a):
                self.denied.append(denial(a))
                return self._error(403, denial(a), "Forbidden")
        try:
            return await self._serve(request, (gv, plural, ns, name), sub)
        except ApiError as exc:
            return self._error(exc.code, exc.message, exc.reason)

    async def _serve(self, request: web.Request, key, sub) -> web.StreamResponse:
        gv, plural, ns, name = key
        if request.method == "GET" and name is None:
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, gv, plural, ns)
            items = [o for (g, p, n, _), o in self.objects.items() if (g, p) == (gv, plural) and ns in (None, n)]
            return web.json_response({"kind": self.kinds[(gv, plural)] + "List", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        if request.method == "POST" and name is None:
            return web.json_response(await self._create(gv, plural, ns, await request.json()), status=201)
        if key not in self.objects and not (request.method == "PATCH" and sub is None):
            return self._error(404, f'{plural} "{name}" not found', "NotFound")
        if request.method == "GET":
            return web.json_response(self.objects[key])
        if request.method == "DELETE":
            options = json.loads(await request.text() or "{}")
            policy = request.query.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
            return web.json_response(await self._delete(gv, plural, ns, name, policy))
        if request.method == "PATCH":
            return await self._patch(request, key, sub)
        return self._error(405, f"{request.method} not supported by the fake")

    async def _patch(self, request: web.Request, key, sub) -> web.Response:
        gv, plural, ns, name = key
        ctype = request.headers.get("Content-Type", "")
        body = json.loads(await request.text())
        if ctype.startswith("application/json-patch+json"):
            if key not in self.objects:
                return self._error(404, f'{plural} "{name}" not found', "NotFound")
            try:
                new = json_patch(self.objects[key], body)
            except (PatchConflict, KeyError, IndexError, ValueError) as exc:
                return self._error(422, f"json patch failed: {exc}")
            if sub == "status":
                new = {**self.objects[key], "status": new.get("status")}
            else:
                new["status"] = self.objects[key].get("status")
            return web.json_response(await self._update(gv, plural, ns, name, new))
        if ctype.startswith("application/apply-patch"):
            if key not in self.objects:  # server-side apply creates
                return web.json_response(await self._create(gv, plural, ns, body), status=201)
            body = {k: v for k, v in body.items() if k not in ("status",)}
        elif not ctype.startswith("application/merge-patch+json"):
            return self._error(415, f"the fake supports json-, merge- and apply-patch only, got {ctype}")
        if key not in self.objects:
            return self._error(404, f'{plural} "{name}" not found', "NotFound")
        old = self.objects[key]
        if sub == "status":
            new = merge(old, {"status": body.get("status")})
        else:  # the status subresource is ignored on the main resource
            new = merge(old, {k: v for k, v in body.items() if k != "status"})
        return web.json_response(await self._update(gv, plural, ns, name, new))

    async def _watch(self, request: web.Request, gv, plural, ns) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        since = int(request.query.get("resourceVersion") or 0)
        deadline = asyncio.get_running_loop().time() + float(request.query.get("timeoutSeconds", 60))
        try:
            while asyncio.get_running_loop().time() < deadline and not self.closing:
                for rv, g, p, etype, obj in list(self.events):
                    if rv > since and (g, p) == (gv, plural) and ns in (None, obj["metadata"].get("namespace")):
                        await resp.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")
                        since = rv
                async with self.changed:
                    try:
                        await asyncio.wait_for(self.changed.wait(), timeout=0.5)
                    except TimeoutError:
                        pass
        except (ConnectionResetError, asyncio.CancelledError):
            return resp
        return resp
