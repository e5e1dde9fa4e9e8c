"""How many CPUs this process may use, and how `splitserve serve` splits them among its workers.

A container's CPU limit is a cgroup quota, not a smaller CPU set: `os.cpu_count()` says 64 in
a pod limited to 4 CPUs, and 64 torch threads there spin against each other. So the count is
the smaller of the scheduler affinity set and the cgroup v2 quota (`cpu.max`, rounded up).

Each worker's intra-op (torch/OpenMP) threads must fit its share: OpenMP threads wait for
each other at every parallel region, so one descheduled thread stalls them all. Measured on
2 cores (docs/benchmarks.md): two workers with 2 threads each served fewer tokens than with 1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("<quota> <period>" or "max <period>") -> CPUs, None if unlimited."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def available_cpus(affinity: int | None = None, cpu_max: str | None = None) -> int:
    """CPUs this process may use: the affinity set, capped by the cgroup quota (rounded up)."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cpu_max is None:
        try:
            cpu_max = CGROUP_CPU_MAX.read_text()
        except OSError:  # cgroup v1 or no cgroup filesystem: the affinity set is all we know
            cpu_max = ""
    quota = parse_cpu_max(cpu_max)
    limit = affinity if quota is None else min(affinity, math.ceil(quota))
    return max(1, limit)


# CPUs left to the serving threads (event loops, gRPC, the router) when there are two or
# more: an engine's OpenMP threads stall whenever one of them is preempted by those. vLLM's
# CPU backend reserves one the same way (VLLM_CPU_NUM_OF_RESERVED_CPU). Measured on 2 cores,
# one decode worker: 2 torch threads 5.4 ms per token at concurrency 1, 1 thread 2.5 ms.
RESERVED_CPUS = 1


def threads_per_worker(cpus: int, workers: int = 1) -> int:
    """Torch threads for each of `workers` engines sharing `cpus`: an equal share of what the
    serving threads leave (RESERVED_CPUS), at least one (more workers than CPUs then share
    cores, as they must)."""
    if workers < 1:
        raise ValueError("at least one worker")
    reserved = RESERVED_CPUS if cpus > RESERVED_CPUS else 0
    return max(1, (cpus - reserved) // workers)
