"""The periodic resync: every InferenceDeployment is reconciled once per interval
(drift correction, status refresh, autoscaling) by one operator-level loop over a
kopf index of the objects the operator watches.

Not a kopf timer: kopf puts its finalizer on every object a timer or daemon runs
for and removes it only while it runs, so with the operator uninstalled first every
InferenceDeployment, and its namespace, would hang in Terminating. An index needs
no finalizer. The index also carries kopf's per-object memo, so the loop and the
change handlers share one lock and one set of autoscaling windows per object.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import kopf

from .kube import ApiError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tracked:
    body: dict  # the object as the watch last delivered it
    memo: kopf.Memo  # kopf's memo for this object, shared with its change handlers


def track(body: kopf.Body, memo: kopf.Memo) -> Tracked:
    return Tracked(body=copy.deepcopy(dict(body)), memo=memo)


Reconcile = Callable[[dict, kopf.Patch, kopf.Memo, logging.Logger], Awaitable[None]]
WriteStatus = Callable[[dict, dict], Awaitable[None]]


async def resync_once(index: kopf.Index, reconcile: Reconcile, write_status: WriteStatus) -> None:
    for store in list(index.values()):
        for tracked in list(store):
            meta = tracked.body["metadata"]
            where = f"InferenceDeployment {meta.get('namespace')}/{meta.get('name')}"
            if meta.get("deletionTimestamp"):
                continue  # being deleted: never re-create what the garbage collector removes
            patch = kopf.Patch()
            try:
                await reconcile(tracked.body, patch, tracked.memo, log)
                if patch.get("status"):
                    await write_status(tracked.body, dict(patch["status"]))
            except kopf.TemporaryError as exc:
                log.info(f"{where}: resync postponed: {exc}")
            except ApiError as exc:
                if exc.status != 404:  # 404: deleted since the watch delivered it
                    log.error(f"{where}: writing status failed: {exc}")
            except Exception:  # one object's failure must not stop the others' resync
                log.exception(f"{where}: resync failed")


async def resync_forever(index: kopf.Index, interval: float, reconcile: Reconcile,
                         write_status: WriteStatus) -> None:
    while True:
        await asyncio.sleep(interval)
        await resync_once(index, reconcile, write_status)
