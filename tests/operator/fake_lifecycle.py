"""Deletion in the fake API server, as kube-apiserver and its controllers do it.

- An object with finalizers is not removed: it gets a deletionTimestamp and stays
  ("Terminating") until its finalizers are gone; no new finalizer may be added then.
- propagationPolicy: Background (default) removes the owner, then the garbage
  collector deletes dependents whose owners are all gone; Foreground keeps the owner
  (finalizer foregroundDeletion) until no dependent with blockOwnerDeletion is left;
  Orphan strips the owner reference from dependents.
- A deleted namespace is Terminating until the namespace controller has deleted its
  content; content held by finalizers keeps it Terminating.
- A deleted CRD (finalizer customresourcecleanup) deletes its custom resources first.

The controllers run synchronously after each write, level-triggered until nothing
changes, so tests never wait for a background garbage collector.
"""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime

FOREGROUND, ORPHAN = "foregroundDeletion", "orphan"
CRD_CLEANUP = "customresourcecleanup.apiextensions.k8s.io"
NAMESPACES = ("v1", "namespaces")
CRDS = ("apiextensions.k8s.io/v1", "customresourcedefinitions")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Lifecycle:
    """Mixed into FakeKube: uses its objects, _store and unregister_crd."""

    objects: dict[tuple[str, str, str | None, str], dict]
    _settle_lock: asyncio.Lock
    _settler: asyncio.Task | None = None

    def terminating(self) -> list[str]:
        """'kind ns/name' of every object stuck with a deletionTimestamp."""
        return sorted(f"{o.get('kind')} {k[2] or ''}/{k[3]}" for k, o in self.objects.items()
                      if o["metadata"].get("deletionTimestamp"))

    async def _delete(self, gv, plural, ns, name, propagation: str = "Background") -> dict:
        obj = copy.deepcopy(self.objects[(gv, plural, ns, name)])
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return obj  # deletion already under way
        finalizers = list(meta.get("finalizers") or [])
        extra = CRD_CLEANUP if (gv, plural) == CRDS else {"Foreground": FOREGROUND, "Orphan": ORPHAN}.get(propagation)
        finalizers += [extra] if extra else []
        if (gv, plural) == NAMESPACES:
            obj["spec"] = {**(obj.get("spec") or {}), "finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Terminating"}
        elif not finalizers:
            result = await self._store(gv, plural, ns, name, obj, "DELETED")
            await self._settle()
            return result
        meta["deletionTimestamp"] = now()
        if finalizers:
            meta["finalizers"] = finalizers
        result = await self._store(gv, plural, ns, name, obj, "MODIFIED")
        await self._settle()
        return result

    async def _settle(self) -> None:
        """Run the controllers until nothing changes. A write made while another
        request's settle is suspended waits for it, then settles its own change."""
        if self._settler is asyncio.current_task():
            return  # a write made by the controllers themselves: the running loop sees it
        async with self._settle_lock:
            self._settler = asyncio.current_task()
            try:
                while await self._controllers_pass():
                    pass
            finally:
                self._settler = None

    def _dependents(self, uid: str) -> list[tuple[tuple, dict]]:
        return [(k, o) for k, o in self.objects.items()
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or [])]

    async def _set_finalizers(self, key, obj: dict, finalizers: list[str]) -> None:
        obj = copy.deepcopy(obj)
        if finalizers:
            obj["metadata"]["finalizers"] = finalizers
        else:
            obj["metadata"].pop("finalizers", None)
        await self._store(*key, obj, "MODIFIED" if finalizers else "DELETED")

    async def _controllers_pass(self) -> bool:
        """One pass of the garbage collector, namespace and CRD controllers; True if
        it changed anything (the caller repeats until it does not)."""
        uids = {o["metadata"]["uid"] for o in self.objects.values()}
        for key, obj in list(self.objects.items()):
            meta = obj["metadata"]
            finalizers = list(meta.get("finalizers") or [])
            if not meta.get("deletionTimestamp"):
                refs = meta.get("ownerReferences") or []
                live = [r for r in refs if r.get("uid") in uids]
                if refs and not live:  # every owner is gone: collect it
                    await self._delete(*key)
                    return True
                if len(live) < len(refs):
                    await self._store(*key, {**obj, "metadata": {**meta, "ownerReferences": live}}, "MODIFIED")
                    return True
                continue
            if FOREGROUND in finalizers:
                dependents = self._dependents(meta["uid"])
                waiting = [k for k, d in dependents if not d["metadata"].get("deletionTimestamp")]
                for k in waiting:
                    await self._delete(*k, propagation="Foreground")
                blocking = [d for _, d in dependents if any(
                    r.get("uid") == meta["uid"] and r.get("blockOwnerDeletion")
                    for r in d["metadata"].get("ownerReferences") or [])]
                if not blocking:
                    await self._set_finalizers(key, obj, [f for f in finalizers if f != FOREGROUND])
                    return True
                if waiting:
                    return True
            if ORPHAN in finalizers:
                for k, d in self._dependents(meta["uid"]):
                    refs = [r for r in d["metadata"]["ownerReferences"] if r.get("uid") != meta["uid"]]
                    await self._store(*k, {**d, "metadata": {**d["metadata"], "ownerReferences": refs}}, "MODIFIED")
                await self._set_finalizers(key, obj, [f for f in finalizers if f != ORPHAN])
                return True
            if CRD_CLEANUP in finalizers:
                kinds = self.crd_resources(obj)
                content = [k for k, o in self.objects.items() if (k[0], k[1]) in kinds]
                fresh = [k for k in content if not self.objects[k]["metadata"].get("deletionTimestamp")]
                for k in fresh:
                    await self._delete(*k)
                if not content:
                    self.unregister_crd(obj)
                    await self._set_finalizers(key, obj, [f for f in finalizers if f != CRD_CLEANUP])
                    return True
                if fresh:
                    return True
            if (key[0], key[1]) == NAMESPACES:
                content = [k for k in self.objects if k[2] == key[3]]
                fresh = [k for k in content if not self.objects[k]["metadata"].get("deletionTimestamp")]
                for k in fresh:
                    await self._delete(*k)
                if not content and not finalizers:
                    await self._store(*key, obj, "DELETED")
                    return True
                if fresh:
                    return True
            elif not finalizers:
                await self._store(*key, obj, "DELETED")
                return True
        return False

    # Provided by FakeKube.
    async def _store(self, gv, plural, ns, name, obj, event_type) -> dict:
        raise NotImplementedError

    def crd_resources(self, crd: dict) -> set[tuple[str, str]]:
        raise NotImplementedError

    def unregister_crd(self, crd: dict) -> None:
        raise NotImplementedError
