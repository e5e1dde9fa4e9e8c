"""Scale to zero, for a role whose minReplicas is 0 (decode): the two steps the ordinary
rules in autoscaler.py cannot take. Pure functions of the policy and the load reports.

- From zero: no worker reports, but routers publish the requests they hold for one
  (router/hold_at_zero.py) as decode load. Any held request scales up at once, without
  the up window: the client is already waiting for a cold start.
- To zero: the last replica goes only when the role's load stayed below the low
  watermark for scaleToZeroAfterSeconds and nothing is waiting or running now. The
  pod's preStop drain still finishes a stream that starts meanwhile.
"""

from __future__ import annotations

import math

from splitserve.cluster.messages import LoadReport


def from_zero(target: float, max_step: int, max_replicas: int, waiting: int) -> tuple[int, str]:
    """(replicas, why) at zero replicas with `waiting` requests held by routers."""
    if waiting <= 0:
        return 0, "scaled to zero, no request held: holding at 0"
    new = min(max(1, math.ceil(waiting / target)), max_step, max_replicas)
    return new, f"{waiting} requests held at zero: scale up 0 -> {new}"


def to_zero_allowed(reports: list[LoadReport], low_for_s: float, idle_after_s: float) -> tuple[bool, str]:
    """Whether the last replica may go; else why not (for the status line)."""
    busy = sum(max(r.waiting, 0) + max(r.running, 0) for r in reports)
    if busy:
        return False, f"{busy} requests waiting or running: keeping 1 (scale to zero needs idle)"
    if low_for_s < idle_after_s:
        return False, f"idle for {low_for_s:.0f}s of {idle_after_s:.0f}s before scaling to zero"
    return True, ""
