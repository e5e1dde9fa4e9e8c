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
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CpuPlan:
    """Where `serve` pins its processes: each engine on CPUs of its own, everything else
    (router, the workers' event loops and gRPC, Ray) on `serving`."""

    serving: tuple[int, ...]
    engines: tuple[tuple[int, ...], ...]  # one entry per worker, in the order they are started

    def describe(self) -> str:
        return (f"engines pinned to CPUs {', '.join(format_cpus(e) for e in self.engines)}; "
                f"serving processes to {format_cpus(self.serving)}")


def pin_plan(cpus: Sequence[int], workers: int, threads: int, reserved: int = RESERVED_CPUS) -> CpuPlan | None:
    """Each of `workers` engines on `threads` CPUs of its own and the serving processes on
    the rest, as vLLM's CPU backend binds its OpenMP threads and leaves a core to its API
    server: an engine that shares its core is preempted mid-step by the router and the
    event loops, and every new request's first token waits for it (measured on 2 cores:
    one decode worker pinned served 9% more tokens at concurrency 32, docs/benchmarks.md).
    None where the CPUs cannot be split so (fewer than the engines' threads plus `reserved`):
    then the kernel's scheduler shares them better than a fixed split would.
    The engines take the last CPUs: CPU 0 handles most interrupts on a typical machine."""
    cpus = sorted(set(cpus))
    engine_total = workers * threads
    if workers < 1 or threads < 1 or len(cpus) - reserved < engine_total:
        return None
    first_engine_cpu = len(cpus) - engine_total
    engines = tuple(tuple(cpus[first_engine_cpu + i * threads : first_engine_cpu + (i + 1) * threads])
                    for i in range(workers))
    return CpuPlan(serving=tuple(cpus[:first_engine_cpu]), engines=engines)


def pin_this_process(cpus: Sequence[int]) -> None:
    """Every thread of this process onto `cpus` (Linux's sched_setaffinity moves one thread;
    threads and processes started later inherit the caller's set)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass


def format_cpus(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5", the way taskset and cpusets write CPU lists."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
