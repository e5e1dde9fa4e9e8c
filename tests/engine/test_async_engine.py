"""The engine thread behind every worker (engine/async_engine.py): what a client's
cancellation, a failing step, a dying thread and a hung step do to it. Faults are
injected the way chaos tests inject them in a real `splitserve serve` (engine/faults.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from splitserve.engine import EngineConfig, SamplingParams
from splitserve.engine.async_engine import AsyncEngine, EngineDeadError
from splitserve.engine.faults import ENV, release_hangs
from splitserve.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model(make_ckpt):
    return str(make_ckpt("llama"))


class Harness:
    """An AsyncEngine on the running loop, recording everything it reports."""

    def __init__(self, model: str, name: str = "e0", **kwargs):
        self.llm = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, model_id="t"))
        self.outputs, self.dead, self.step_failures = [], [], []
        self.engine = AsyncEngine(self.llm, asyncio.get_running_loop(), self.outputs.extend, name=name,
                                  on_dead=self.dead.append, on_step_failure=lambda r, e: self.step_failures.append(r),
                                  **kwargs)
        self.engine.start()

    async def idle_and_free(self) -> bool:
        llm = self.llm
        return await self.engine.call(lambda: not llm.sequences and llm.num_free_blocks == llm.num_total_blocks)

    def finished(self, rid: str):
        return next((o for o in self.outputs if o.request_id == rid and o.finished), None)


async def test_a_caller_cancelled_while_its_command_runs_does_not_kill_the_thread(model):
    """The storm bug: aiohttp cancels a handler awaiting engine.call; the command was
    running; answering its cancelled future raised InvalidStateError twice and the thread died."""
    h = Harness(model)
    running, release = threading.Event(), threading.Event()

    def slow_add():
        running.set()
        release.wait(5)
        return h.llm.add_request("r1", [5] * 20, PARAMS)

    task = asyncio.create_task(h.engine.call(slow_add))
    await asyncio.to_thread(running.wait, 5)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await h.engine.call(lambda: "still here") == "still here"
    assert h.engine.alive and h.engine.error is None
    await h.engine.call(h.llm.abort, "r1")  # what the worker's finally does: the command was applied
    assert await h.idle_and_free()
    h.engine.stop()


async def test_a_command_whose_caller_left_before_it_ran_is_not_applied(model):
    h = Harness(model)
    release = threading.Event()
    blocker = asyncio.create_task(h.engine.call(release.wait, 5))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(h.engine.call(h.llm.add_request, "never", [5] * 20, PARAMS))
    await asyncio.sleep(0.05)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    await asyncio.sleep(0.01)  # the cancellation reaches the command's future (callbacks on the loop)
    release.set()
    await blocker
    assert await h.engine.call(lambda: "never" not in h.llm.sequences)
    assert await h.idle_and_free()
    h.engine.stop()


async def test_many_random_cancellations_leave_every_block_free(model):
    h = Harness(model)
    for i in range(60):
        call = asyncio.create_task(h.engine.call(h.llm.add_request, f"r{i}", [5 + i] * (10 + i), PARAMS))
        await asyncio.sleep((i % 4) * 0.001)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        if i % 3:
            await h.engine.call(h.llm.abort, f"r{i}")
    await asyncio.sleep(0.5)  # those not aborted run to their end
    assert await h.idle_and_free() and h.engine.alive
    h.engine.stop()


def arm(monkeypatch, *faults: dict) -> None:
    monkeypatch.setenv(ENV, json.dumps(list(faults)))


async def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(model, monkeypatch):
    arm(monkeypatch, {"engine": "e1", "fault": "raise", "at_step": 3})
    h = Harness(model, name="e1")
    await h.engine.call(h.llm.add_request, "a", [7] * 30, PARAMS)
    await h.engine.call(h.llm.add_request, "b", [8] * 30, PARAMS)
    while not (h.finished("a") and h.finished("b")):
        await asyncio.sleep(0.01)
    for rid in "ab":
        out = h.finished(rid)
        assert out.finish_reason == "abort" and "injected step failure" in out.error, out
    assert h.step_failures == [["a", "b"]] and h.engine.step_failures == 1 and not h.dead
    await h.engine.call(h.llm.add_request, "c", [9] * 30, PARAMS)  # the engine still serves
    while not h.finished("c"):
        await asyncio.sleep(0.01)
    assert h.finished("c").error is None and len(h.finished("c").token_ids) == 40
    assert await h.idle_and_free()
    h.engine.stop()


async def test_three_failing_steps_in_a_row_declare_the_engine_dead(model, monkeypatch):
    arm(monkeypatch, *({"engine": "e2", "fault": "raise", "at_step": n} for n in (1, 2, 3)))
    h = Harness(model, name="e2", max_step_failures=3)
    for i in range(3):
        await h.engine.call(h.llm.add_request, f"r{i}", [7] * 20, PARAMS)
        while not h.finished(f"r{i}"):
            await asyncio.sleep(0.01)
    while not h.dead:
        await asyncio.sleep(0.01)
    assert isinstance(h.dead[0], EngineDeadError) and "3 engine steps failed in a row" in str(h.dead[0])
    assert not h.engine.alive
    with pytest.raises(EngineDeadError):
        await h.engine.call(lambda: 1)


async def test_a_dying_thread_reports_once_and_refuses_further_calls(model, monkeypatch):
    arm(monkeypatch, {"engine": "e3", "fault": "die", "at_step": 2})
    h = Harness(model, name="e3")
    await h.engine.call(h.llm.add_request, "r", [7] * 20, PARAMS)
    while not h.dead:
        await asyncio.sleep(0.01)
    assert len(h.dead) == 1 and "injected engine death" in repr(h.dead[0])
    ok, why = h.engine.health()
    assert not ok and "dead" in why
    with pytest.raises(EngineDeadError):
        await h.engine.call(lambda: 1)


async def test_a_hung_step_is_reported_as_stalled(model, monkeypatch):
    arm(monkeypatch, {"engine": "e4", "fault": "hang", "at_step": 1})
    h = Harness(model, name="e4", stall_timeout_s=0.2)
    await h.engine.call(h.llm.add_request, "r", [7] * 20, PARAMS)
    assert h.engine.health() == (True, "")
    await asyncio.sleep(0.5)
    ok, why = h.engine.health()
    assert not ok and "stalled" in why and h.engine.step_running_s() > 0.2
    release_hangs()
    while not h.finished("r"):
        await asyncio.sleep(0.01)
    assert h.engine.health() == (True, "")
    h.engine.stop()


async def test_a_slow_engine_takes_step_ms_longer_for_every_step_from_at_step(model, monkeypatch):
    arm(monkeypatch, {"engine": "e5", "fault": "slow", "at_step": 5, "step_ms": 30})
    timings: list[float] = []
    h = Harness(model, name="e5", on_step_timing=lambda wall, cpu: timings.append(wall))
    await h.engine.call(h.llm.add_request, "r", [7] * 20, PARAMS)
    while not h.finished("r"):
        await asyncio.sleep(0.01)
    assert len(h.finished("r").token_ids) == 40 and h.finished("r").error is None
    assert all(t >= 0.030 for t in timings[5:]) and len(timings) >= 40, timings
    assert sum(t >= 0.030 for t in timings[:5]) <= 1, timings[:5]  # the first steps ran at full speed
    h.engine.stop()


@pytest.mark.parametrize("spec, why", [
    ({"fault": "slow", "at_step": 0}, "step_ms > 0 goes with fault 'slow'"),
    ({"fault": "die", "at_step": 0, "step_ms": 5}, "step_ms > 0 goes with fault 'slow'"),
    ({"fault": "slow", "at_step": 0, "step_ms": 5, "once_file": "/tmp/x"}, "takes no once_file"),
    ({"fault": "melt", "at_step": 0}, "is not one of"),
])
def test_a_malformed_fault_plan_is_refused_with_the_reason(monkeypatch, spec, why):
    from splitserve.engine.faults import FaultPlan
    arm(monkeypatch, {"engine": "e6", **spec})
    with pytest.raises(ValueError, match=why):
        FaultPlan.from_env("e6")


async def test_the_stats_after_a_step_count_a_request_handed_over_during_it(model):
    """A step can take seconds; a prompt handed over meanwhile is in the snapshot taken right
    after that step (load reports are made from it), not only in the one after the next."""
    h = Harness(model, name="e9")
    await h.engine.add_request("a", [5] * 20, PARAMS)  # keeps steps coming
    entered, release = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    original = h.llm.step

    def held_step():
        for i in (0, 1):
            if not release[i].is_set():
                entered[i].set()
                release[i].wait(5)
                break
        return original()

    h.llm.step = held_step
    await asyncio.to_thread(entered[0].wait, 5)
    handed_at = time.time()
    adding = asyncio.create_task(h.engine.add_request("b", [7] * 300, PARAMS))  # queued while step k runs
    await asyncio.sleep(0.05)
    release[0].set()
    await adding
    await asyncio.to_thread(entered[1].wait, 5)  # step k + 1 holds: the stats are step k's
    stats = h.engine.stats
    release[1].set()
    assert stats.taken_at > handed_at
    assert stats.waiting == 1 and stats.queued_prompt_tokens == 300
    h.engine.stop()


async def test_a_stopped_engine_leaves_no_disk_tier_files(model, tmp_path):
    """--engine-loop thread: the worker's stop removes the tier's directory (the engine process
    does the same before it exits), not an interpreter exit that may never come."""
    llm = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, model_id="t", kv_offload_dir=str(tmp_path),
                                 kv_offload_dir_bytes=1 << 24))
    engine = AsyncEngine(llm, asyncio.get_running_loop(), lambda outputs: None, name="e0")
    engine.start()
    await engine.call(lambda: llm.add_request("r1", [5] * 40, PARAMS))
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob("kv-*/*.kv")):  # idle blocks written down
        assert time.monotonic() < deadline, "nothing reached the disk tier"
        await asyncio.sleep(0.05)
    await asyncio.to_thread(engine.stop)
    assert list(tmp_path.iterdir()) == []
