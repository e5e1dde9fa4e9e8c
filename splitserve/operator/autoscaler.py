"""The scaling decision for one role (prefill or decode): a pure function of the
policy, the current replicas, the workers' load reports, the time, and the
hysteresis windows carried from the previous tick.

Rules, each aimed at a known operator failure:
- No fresh data (no reports, or all older than staleAfterSeconds): hold, and restart
  the windows. A missing metric is not zero load; scaling down on it kills capacity
  exactly when the bus or the workers are in trouble.
- Load per replica = waiting requests / *desired* replicas, not / reporting workers:
  new pods that have not reported yet still count, so a burst does not keep scaling
  up while the first new pods load weights (overshoot).
- Up only after the load stayed above target for the whole up window; down only
  after it stayed below target x lowWatermark for the whole down window; any sample
  in between resets both. After a step the windows restart, which is the cooldown.
- A step is at most maxStep, and down never goes below ceil(waiting / target), so a
  scale-down cannot by itself push the load back above target (no oscillation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.cluster.messages import LoadReport

from .scale_to_zero import from_zero, to_zero_allowed
from .spec import AutoscalingSpec, RoleSpec


@dataclass(frozen=True)
class ScalingPolicy:
    min_replicas: int
    max_replicas: int
    target: float  # waiting requests per replica
    low_watermark: float  # scale down below target * low_watermark
    up_window_s: float
    down_window_s: float
    max_step: int
    stale_after_s: float
    scale_to_zero_after_s: float = 600.0  # only with min_replicas 0 (scale_to_zero.py)

    @classmethod
    def for_role(cls, role: RoleSpec, a: AutoscalingSpec) -> ScalingPolicy:
        return cls(role.min_replicas, role.max_replicas, a.target_waiting_per_replica, a.low_watermark,
                   a.scale_up_window_seconds, a.scale_down_window_seconds, a.max_step, a.stale_after_seconds,
                   a.scale_to_zero_after_seconds)


@dataclass(frozen=True)
class Windows:
    above_since: float | None = None
    below_since: float | None = None


@dataclass(frozen=True)
class Decision:
    replicas: int
    windows: Windows
    reason: str  # one line for the status and the log: what was seen, what was done
    waiting: int | None = None  # total waiting requests seen; None without fresh data

    def changed(self, current: int) -> bool:
        return self.replicas != current


def fresh_reports(reports: Iterable[LoadReport], now: float, stale_after_s: float) -> list[LoadReport]:
    """The newest report per worker, dropping those older than stale_after_s."""
    newest: dict[str, LoadReport] = {}
    for r in reports:
        if r.worker_id not in newest or r.timestamp > newest[r.worker_id].timestamp:
            newest[r.worker_id] = r
    return [r for r in newest.values() if now - r.timestamp <= stale_after_s]


def decide(policy: ScalingPolicy, current: int, reports: list[LoadReport], now: float,
           windows: Windows) -> Decision:
    bounded = min(max(current, policy.min_replicas), policy.max_replicas)
    if bounded != current:
        return Decision(bounded, Windows(), f"replicas {current} outside [{policy.min_replicas}, "
                        f"{policy.max_replicas}]: set to {bounded}")
    fresh = fresh_reports(reports, now, policy.stale_after_s)
    if not fresh:
        if reports:
            age = now - max(r.timestamp for r in reports)
            why = f"stale load reports (newest {age:.0f}s old > {policy.stale_after_s:.0f}s)"
        else:
            why = "no load reports on the cluster bus"
        return Decision(current, Windows(), f"{why}: holding at {current}")
    waiting = sum(max(r.waiting, 0) for r in fresh)
    if current == 0:  # only reachable with minReplicas 0: the load is what routers hold
        new, why = from_zero(policy.target, policy.max_step, policy.max_replicas, waiting)
        return Decision(new, Windows(), why, waiting)
    per_replica = waiting / current
    seen = f"{waiting} waiting over {current} replicas ({per_replica:.2f}/replica, target {policy.target:g})"

    if per_replica > policy.target:
        since = windows.above_since if windows.above_since is not None else now
        if now - since < policy.up_window_s:
            return Decision(current, Windows(above_since=since), f"{seen}: above target for "
                            f"{now - since:.0f}s of {policy.up_window_s:.0f}s", waiting)
        wanted = max(math.ceil(waiting / policy.target), current + 1)
        new = min(wanted, current + policy.max_step, policy.max_replicas)
        if new == current:
            return Decision(current, Windows(above_since=since), f"{seen}: at maxReplicas {current}", waiting)
        return Decision(new, Windows(), f"{seen}: scale up {current} -> {new}", waiting)

    if per_replica < policy.target * policy.low_watermark:
        since = windows.below_since if windows.below_since is not None else now
        if now - since < policy.down_window_s:
            return Decision(current, Windows(below_since=since), f"{seen}: below "
                            f"{policy.low_watermark:g} x target for {now - since:.0f}s of "
                            f"{policy.down_window_s:.0f}s", waiting)
        new = max(math.ceil(waiting / policy.target), current - policy.max_step, policy.min_replicas)
        if new == 0:
            allowed, why = to_zero_allowed(fresh, now - since, policy.scale_to_zero_after_s)
            if not allowed:
                new = 1
                if current == 1:
                    return Decision(current, Windows(below_since=since), f"{seen}: {why}", waiting)
        if new >= current:
            return Decision(current, Windows(below_since=since), f"{seen}: at minReplicas or needed "
                            f"capacity {current}", waiting)
        return Decision(new, Windows(), f"{seen}: scale down {current} -> {new}", waiting)

    return Decision(current, Windows(), f"{seen}: within band, holding", waiting)
