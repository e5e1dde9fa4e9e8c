"""A tensor-parallel engine in its own process (engine/engine_process.py, as workers run it
on the CPU): the worker receives every rank's KV pool as one ShardedKVPool over shared
memory, and a rank process killed while the engine idles ends the engine within a ping or
two (the child's ping answer says so), not at the next request; a rank process frozen
(SIGSTOP) makes the engine unhealthy within the heartbeat timeout, naming it, until it thaws."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from splitserve.engine import EngineConfig
from splitserve.engine.engine_process import EngineProcess
from splitserve.engine.parallel.kv_shards import ShardedKVPool


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


async def test_an_idle_engine_whose_rank_is_killed_dies_at_once(make_ckpt):
    died = asyncio.Event()
    errors: list[BaseException] = []
    config = EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=32, model_id="tp", tensor_parallel_size=2)
    proc = EngineProcess(config, asyncio.get_running_loop(), lambda outputs: None, name="tp",
                         on_dead=lambda exc: (errors.append(exc), died.set()))
    await asyncio.to_thread(proc.launch)
    proc.start()
    try:
        pool = proc.kv_pool
        assert isinstance(pool, ShardedKVPool) and len(pool.shards) == 2
        assert pool.spec.num_kv_heads == 2 and [s.shape[4] for s in pool.shards] == [1, 1]  # one head a rank
        (rank1,) = children(proc.pid)
        await asyncio.sleep(1.0)
        assert not died.is_set()  # idle and whole: nothing to say
        os.kill(rank1, signal.SIGKILL)
        await asyncio.wait_for(died.wait(), timeout=5)
        assert f"a rank process is gone (pid {rank1}, splitserve-tp-rank1, exit code -9)" in str(errors[0])
        ok, why = proc.health()
        assert not ok, why
    finally:
        proc.stop()
    assert not proc.alive


async def test_a_frozen_rank_makes_the_engine_unhealthy_until_it_thaws(make_ckpt):
    timeout = 1.5
    config = EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=32, model_id="tp", tensor_parallel_size=2)
    proc = EngineProcess(config, asyncio.get_running_loop(), lambda outputs: None, name="tp-freeze",
                         heartbeat_timeout_s=timeout)
    await asyncio.to_thread(proc.launch)
    proc.start()
    try:
        (rank1,) = children(proc.pid)
        started = time.monotonic()
        while not proc.health()[0] and time.monotonic() - started < 30:  # (a loaded machine: late pongs)
            await asyncio.sleep(0.05)
        assert proc.health() == (True, "")
        os.kill(rank1, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            while proc.health()[0] and time.monotonic() - frozen < 30:
                await asyncio.sleep(0.05)
            took = time.monotonic() - frozen
            ok, why = proc.health()
            assert not ok and f"tensor-parallel rank 1 (pid {rank1}) has not answered a heartbeat" in why, why
            assert proc.alive and proc.heartbeat_age_s() < timeout  # rank 0 itself answers
            print(f"a frozen rank: unhealthy {took:.1f} s after SIGSTOP (timeout {timeout} s)")
        finally:
            os.kill(rank1, signal.SIGCONT)
        while not proc.health()[0] and time.monotonic() - frozen < 60:
            await asyncio.sleep(0.05)
        assert proc.health() == (True, "")
    finally:
        proc.stop()
