"""Status: observed children -> readiness per role and conditions. Pure.

Ready is True only when every role has all its desired replicas ready *and* up to
date (a rollout in progress is not ready), and the Ray head is up.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoleObservation:
    desired: int
    ready: int
    found: bool = True  # the child object exists
    up_to_date: bool = True  # controller has observed the latest generation, rollout done

    @property
    def is_ready(self) -> bool:
        return self.found and self.up_to_date and self.ready >= self.desired


def observe_deployment(obj: dict | None, desired: int) -> RoleObservation:
    if obj is None:
        return RoleObservation(desired, 0, found=False, up_to_date=False)
    st = obj.get("status") or {}
    up_to_date = (st.get("observedGeneration", 0) >= obj["metadata"].get("generation", 0)
                  and st.get("updatedReplicas", 0) >= desired
                  and st.get("replicas", 0) <= desired)  # no old pods still terminating/surging
    return RoleObservation(desired, int(st.get("readyReplicas", 0) or 0), up_to_date=up_to_date)


def observe_raycluster(obj: dict | None, desired: int) -> RoleObservation:
    """KubeRay: workers ready per status.readyWorkerReplicas; the head must be ready
    too (condition HeadPodReady, or state 'ready' on KubeRay versions without it)."""
    if obj is None:
        return RoleObservation(desired, 0, found=False, up_to_date=False)
    st = obj.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in st.get("conditions") or []}
    head_ready = conditions.get("HeadPodReady") == "True" or st.get("state") == "ready"
    ready = int(st.get("readyWorkerReplicas", 0) or 0) if head_ready else 0
    return RoleObservation(desired, ready, up_to_date=head_ready)


def _condition(type_: str, ok: bool, reason: str, message: str, previous: dict[str, dict],
               now: str, generation: int) -> dict:
    status = "True" if ok else "False"
    before = previous.get(type_)
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def conditions(roles: dict[str, RoleObservation], problem: tuple[str, str] | None,
               previous: list[dict], now: str, generation: int) -> list[dict]:
    """`problem` = (reason, message) when the spec is invalid or applying failed."""
    prev = {c["type"]: c for c in previous or [] if "type" in c}
    if not roles:  # nothing could be reconciled (invalid spec, no token Secret): no claim about readiness
        reason, message = problem or ("NotReconciled", "not reconciled yet")
        blocked = "blocked until the spec is fixed" if reason == "InvalidSpec" else "blocked until the cause is fixed"
        return [_condition("Ready", False, reason, "not reconciled: " + message, prev, now, generation),
                _condition("Progressing", False, reason, blocked, prev, now, generation),
                _condition("Degraded", True, reason, message, prev, now, generation)]
    not_ready = [f"{role} {o.ready}/{o.desired} ready" + ("" if o.found else " (missing)")
                 for role, o in roles.items() if not o.is_ready]
    ready = not not_ready
    summary = ", ".join(f"{role} {o.ready}/{o.desired}" for role, o in roles.items())
    out = [_condition("Ready", ready, "AllRolesReady" if ready else "RolesNotReady",
                      f"all roles ready: {summary}" if ready else "waiting for " + ", ".join(not_ready),
                      prev, now, generation)]
    rolling = [role for role, o in roles.items() if not o.up_to_date or o.ready != o.desired]
    out.append(_condition("Progressing", bool(rolling), "RollingOut" if rolling else "Stable",
                          ("rolling out " + ", ".join(rolling)) if rolling else "every role at its desired state",
                          prev, now, generation))
    degraded_reason, degraded_message = problem or ("AsExpected", "spec valid and every child applied")
    out.append(_condition("Degraded", problem is not None, degraded_reason, degraded_message, prev, now,
                          generation))
    return out


def status_patch(roles: dict[str, RoleObservation], conds: list[dict], generation: int,
                 queue: dict[str, int | None]) -> dict:
    """The status fields besides scaling state (printer columns read these)."""
    patch: dict = {"observedGeneration": generation, "conditions": conds}
    for role, o in roles.items():
        patch[role] = {"ready": o.ready, "desired": o.desired}
        if role in queue and queue[role] is not None:
            patch[role]["queue"] = queue[role]
    for role in ("prefill", "decode"):
        if role in roles:
            patch[f"{role}Replicas"] = f"{roles[role].ready}/{roles[role].desired}"
    seen = [v for v in queue.values() if v is not None]
    patch["queue"] = sum(seen) if seen else None  # None deletes the field: unknown, not zero
    return patch
