"""`splitserve serve` pins each CPU engine to cores of its own and everything else to the
rest (core/cpus.py), where the CPUs allow it: the plan (pure), when serve makes one, and a
real serve whose engine process and serving processes are found on exactly those CPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests

from splitserve.core.cpus import CpuPlan, format_cpus, pin_plan
from splitserve.serve import build_parser, cpu_plan


@pytest.mark.parametrize(("cpus", "workers", "threads", "serving", "engines"), [
    ([0, 1], 1, 1, (0,), ((1,),)),  # this machine with one decode worker: vLLM's layout
    (range(16), 3, 5, (0,), ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10), (11, 12, 13, 14, 15))),
    (range(8), 2, 3, (0, 1), ((2, 3, 4), (5, 6, 7))),  # a CPU left over stays with the serving side
    ([7, 6, 3, 2], 1, 3, (2,), ((3, 6, 7),)),  # an affinity set with holes, in any order
])
def test_each_engine_gets_cpus_of_its_own(cpus, workers, threads, serving, engines):
    plan = pin_plan(cpus, workers, threads)
    assert plan == CpuPlan(serving, engines)
    assert not set(plan.serving) & {c for e in plan.engines for c in e}


@pytest.mark.parametrize(("cpus", "workers", "threads"), [
    ([0, 1], 2, 1),  # two engines, one CPU beside the reserved one: they must share, so no pinning
    ([0, 1, 2, 3], 2, 2),  # --torch-threads larger than an exclusive split
    ([0], 1, 1),  # one CPU: nothing to reserve
    (range(4), 0, 1),
])
def test_no_plan_where_engines_would_share(cpus, workers, threads):
    assert pin_plan(cpus, workers, threads) is None


@pytest.mark.parametrize(("cpus", "text"), [((0,), "0"), ((0, 1, 2, 5), "0-2,5"), ((7, 3, 4), "3-4,7"),
                                           ((1, 3, 5), "1,3,5")])
def test_cpu_lists_read_like_tasksets(cpus, text):
    assert format_cpus(cpus) == text


def _plan(argv: list[str], engine_process=None, affinity=(0, 1), usable=2):
    return cpu_plan(build_parser().parse_args(argv), engine_process, 1, list(affinity), usable)


def test_serve_pins_only_what_it_owns_and_was_not_told_otherwise():
    one = ["--prefill-workers", "0", "--decode-workers", "1"]
    assert _plan(one) == CpuPlan((0,), ((1,),))
    assert _plan(one, engine_process=True) == CpuPlan((0,), ((1,),))
    assert _plan([*one, "--no-cpu-pinning"]) is None
    assert _plan([*one, "--device", "cuda"]) is None  # the GPU sets the pace there
    assert _plan(one, engine_process=False) is None  # --engine-loop thread: one process for both
    assert _plan(one, affinity=range(8), usable=2) is None  # a 2-CPU quota on 8 shared CPUs
    assert _plan([*one, "--cpus", "1"]) is None  # fewer CPUs than the set: which ones is not ours to pick
    assert _plan([*one, "--cpus", "2"]) == CpuPlan((0,), ((1,),))
    assert _plan([]) is None  # the default 1 prefill + 1 decode on 2 CPUs: they share the engine CPU


def _allowed(pid: int) -> set[str]:
    """The CPU list of every thread of `pid`."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        out.add(next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")))
    return out


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process below `root` (Ray's processes among them)."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    below, frontier = {}, [root]
    while frontier:
        p = frontier.pop()
        for child, par in parent.items():
            if par == p and child not in below:
                below[child] = cmd[child]
                frontier.append(child)
    return below


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs")
def test_a_served_engine_runs_on_its_cpus_and_the_serving_processes_on_the_others(shared_serve):
    cpus = sorted(os.sched_getaffinity(0))
    want = pin_plan(cpus, 1, len(cpus) - 1)
    serve = shared_serve("llama-0p1d")  # tests/helpers/shared_serve.py: 0 prefill + 1 decode, served as "m"
    assert f"splitserve: {want.describe()}" in serve.log()
    body = requests.post(serve.base_url + "/v1/completions", timeout=60,
                         json={"model": "m", "prompt": [5] * 40, "max_tokens": 4, "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 4, body
    procs = _descendants(serve.proc.pid)
    engines = [p for p, c in procs.items() if "multiprocessing.spawn" in c and "spawn_main" in c]
    assert len(engines) == 1, procs
    assert _allowed(engines[0]) == {format_cpus(want.engines[0])}
    serving = [serve.proc.pid, *(p for p, c in procs.items() if p not in engines and ("ray" in c or "python" in c))]
    assert len(serving) >= 3, procs  # serve itself, Ray's processes, the worker actor
    assert {p: _allowed(p) for p in serving} == dict.fromkeys(serving, {format_cpus(want.serving)})
