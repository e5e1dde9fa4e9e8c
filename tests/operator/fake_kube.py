"""A FAKE Kubernetes API server (aiohttp on 127.0.0.1) for running the operator's
kopf handlers in tests. No real API server can run on the test machines.

It implements only what kopf and the operator call: discovery (/api, /apis, group
versions), list + watch (JSON-lines events, resourceVersion), get, create,
merge-patch, a simplified server-side apply (create-or-deep-merge; unlike the real
one it does not remove fields the manager stopped sending), the status
subresource, delete with finalizers and deletionTimestamp, and owner-reference
garbage collection. No admission, no CEL, no defaulting, no controllers: tests set
children's status themselves (e.g. readyReplicas) to play the controllers' part.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from datetime import UTC, datetime

from aiohttp import web

PATH = re.compile(r"^/(?P<gv>api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
                  r"(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$")


def merge(target: dict, patch: dict) -> dict:
    """RFC 7386 JSON merge patch."""
    out = copy.deepcopy(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class PatchConflict(Exception):
    pass


def json_patch(target: dict, ops: list[dict]) -> dict:
    """RFC 6902 JSON patch: add, replace, remove, test (what kopf sends)."""
    out = copy.deepcopy(target)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent = out
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        if op["op"] == "test":
            current = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if current != op["value"]:
                raise PatchConflict(f"test failed at {op['path']}")
        elif op["op"] in ("add", "replace"):
            if isinstance(parent, list):
                parent.append(op["value"]) if last == "-" else parent.insert(int(last), op["value"]) \
                    if op["op"] == "add" else parent.__setitem__(int(last), op["value"])
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            parent.pop(int(last) if isinstance(parent, list) else last)
    return out


class FakeKube:
    def __init__(self, kinds: dict[tuple[str, str], str]):
        """kinds: (apiVersion like 'apps/v1' or 'v1', plural) -> Kind. Only these are served;
        objects are keyed by (apiVersion, plural, namespace, name)."""
        self.kinds = kinds
        self.objects: dict[tuple[str, str, str, str], dict] = {}  # (gv, plural, ns, name)
        self.events: list[tuple[int, str, str, str, dict]] = []  # (rv, gv, plural, type, obj)
        self.rv = 1
        self.changed = asyncio.Condition()
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.closing = False
        self.kinds[("v1", "namespaces")] = "Namespace"  # kopf lists/watches namespaces

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
    def get(self, gv: str, plural: str, ns: str, name: str) -> dict | None:
        obj = self.objects.get((gv, plural, ns, name))
        return copy.deepcopy(obj) if obj else None

    def list(self, gv: str, plural: str, ns: str) -> list[dict]:
        return [copy.deepcopy(o) for (g, p, n, _), o in self.objects.items() if (g, p, n) == (gv, plural, ns)]

    async def create_namespace(self, name: str) -> dict:
        return await self._create("v1", "namespaces", None, {"metadata": {"name": name}})

    async def create(self, gv: str, plural: str, ns: str, body: dict) -> dict:
        """Create as a user would (kubectl create)."""
        return await self._create(gv, plural, ns, body)

    async def patch_spec(self, gv: str, plural: str, ns: str, name: str, patch: dict) -> dict:
        """Merge-patch as a user would (kubectl patch --type merge)."""
        obj = self.objects[(gv, plural, ns, name)]
        return await self._update(gv, plural, ns, name, merge(obj, patch))

    async def set_status(self, gv: str, plural: str, ns: str, name: str, status: dict) -> None:
        """Play a controller: write a child's status (e.g. readyReplicas)."""
        obj = self.objects[(gv, plural, ns, name)]
        await self._store(gv, plural, ns, name, {**obj, "status": status}, "MODIFIED")

    async def remove(self, gv: str, plural: str, ns: str, name: str) -> None:
        """Delete as a user would (kubectl delete), with garbage collection."""
        await self._delete(gv, plural, ns, name)

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
        if ns:
            meta["namespace"] = ns
        meta.update(uid=str(uuid.uuid4()), generation=1,
                    creationTimestamp=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        obj.setdefault("apiVersion", gv)
        obj.setdefault("kind", self.kinds[(gv, plural)])
        return await self._store(gv, plural, ns, meta["name"], obj, "ADDED")

    async def _update(self, gv, plural, ns, name, new) -> dict:
        old = self.objects[(gv, plural, ns, name)]
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return await self._delete(gv, plural, ns, name, new)
        return await self._store(gv, plural, ns, name, new, "MODIFIED")

    async def _delete(self, gv, plural, ns, name, obj=None) -> dict:
        obj = copy.deepcopy(obj or self.objects[(gv, plural, ns, name)])
        if obj["metadata"].get("finalizers"):
            obj["metadata"].setdefault("deletionTimestamp", datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            return await self._store(gv, plural, ns, name, obj, "MODIFIED")
        result = await self._store(gv, plural, ns, name, obj, "DELETED")
        uid = obj["metadata"]["uid"]  # garbage collection of dependents
        for (g, p, n, nm), child in list(self.objects.items()):
            if any(r.get("uid") == uid for r in child["metadata"].get("ownerReferences") or []):
                await self._delete(g, p, n, nm)
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
                resources.append({"name": plural, "singularName": kind.lower(), "namespaced": kind != "Namespace",
                                  "kind": kind, "verbs": verbs})
                resources.append({"name": f"{plural}/status", "singularName": "", "namespaced": True,
                                  "kind": kind, "verbs": ["get", "patch", "update"]})
        if not resources:
            return None
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "message": message, "code": status}, status=status)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.requests.append((request.method, path))
        m = PATH.match(path)
        if m is None:
            found = self._discovery(path) if request.method == "GET" else None
            return web.json_response(found) if found else self._error(404, f"{path} not found")
        gv, ns, plural, name, sub = self._gv(m["gv"]), m["ns"], m["plural"], m["name"], m["sub"]
        if (gv, plural) not in self.kinds:
            return self._error(404, f"the server could not find the requested resource ({path})")
        key = (gv, plural, ns, name)
        if request.method == "GET" and name is None:
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, gv, plural, ns)
            items = [o for (g, p, n, _), o in self.objects.items() if (g, p) == (gv, plural) and ns in (None, n)]
            return web.json_response({"kind": self.kinds[(gv, plural)] + "List", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        if request.method == "POST" and name is None:
            body = await request.json()
            if (gv, plural, ns, body["metadata"]["name"]) in self.objects:
                return self._error(409, f"{plural} {body['metadata']['name']} already exists")
            return web.json_response(await self._create(gv, plural, ns, body), status=201)
        if request.method == "GET":
            return web.json_response(self.objects[key]) if key in self.objects else self._error(404, f"{name} not found")
        if request.method == "DELETE":
            if key not in self.objects:
                return self._error(404, f"{name} not found")
            return web.json_response(await self._delete(gv, plural, ns, name))
        if request.method == "PATCH":
            return await self._patch(request, key, sub)
        return self._error(405, f"{request.method} not supported by the fake")

    async def _patch(self, request: web.Request, key, sub) -> web.Response:
        gv, plural, ns, name = key
        ctype = request.headers.get("Content-Type", "")
        body = json.loads(await request.text())
        if ctype.startswith("application/json-patch+json"):
            if key not in self.objects:
                return self._error(404, f"{name} not found")
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
            return self._error(404, f"{name} not found")
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
