"""An engine process frozen between steps is seen (issue 39): before, stall detection timed
only a running step, so an idle engine stopped with SIGSTOP (or hung in a system call) left
its worker `ok` and registered, and requests routed there hung. The child's main thread now
answers the worker's pings whatever the engine does; no answer within
--engine-heartbeat-timeout makes the worker unhealthy (503, out of the registry, so new
requests go elsewhere and the router migrates its streams) until it answers again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub

BOUND_S = 1.5


async def registered(bus, worker_id: str, expected: bool, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (worker_id in await bus.live_workers()) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def worker(make_ckpt):
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=64,
                                                          model_id="test-model"),
                                             worker_id="d-freeze", engine_process=True, heartbeat_ttl_s=1.5,
                                             engine_heartbeat_timeout_s=BOUND_S), bus=bus)
    await decode.start()
    decode.bus_for_test = bus
    yield decode
    if decode.engine is not None and decode.engine.alive:
        os.kill(decode.engine.pid, signal.SIGCONT)  # never leave a stopped process behind
    await decode.stop()


async def test_an_idle_engine_frozen_between_steps_takes_its_worker_out_until_it_thaws(worker):
    bus = worker.bus_for_test
    assert (await worker.health())[0] and "d-freeze" in await bus.live_workers()
    os.kill(worker.engine.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        await registered(bus, "d-freeze", False, "the worker to leave the registry")
        took = time.monotonic() - frozen
        ok, status, detail = await worker.health()
        assert not ok and status == "engine_unhealthy"
        assert f"engine process {worker.engine.pid} has not answered a heartbeat" in detail and "frozen" in detail
        print(f"left the registry {took:.1f} s after the freeze (bound {BOUND_S} s)")
    finally:
        os.kill(worker.engine.pid, signal.SIGCONT)
    await registered(bus, "d-freeze", True, "the worker to register again")
    assert (await worker.health())[0]
    # and it serves: nothing was lost while it was stopped
    async with grpc.aio.insecure_channel(worker.address) as ch:
        call = DecodeWorkerStub(ch).Generate(pb.GenerateRequest(
            request_id="after", prompt_token_ids=list(range(5, 30)),
            sampling=sampling_to_proto(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))))
        tokens = []
        async for chunk in call:
            tokens.extend(chunk.token_ids)
    assert len(tokens) == 4


async def test_a_busy_engine_answers_its_heartbeat_while_it_steps(worker):
    """A long step is the stall timeout's business, not the heartbeat's: the child's main
    thread answers while the engine thread computes."""
    async with grpc.aio.insecure_channel(worker.address) as ch:
        call = DecodeWorkerStub(ch).Generate(pb.GenerateRequest(
            request_id="busy", prompt_token_ids=list(range(5, 40)),
            sampling=sampling_to_proto(SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))))
        deadline = time.monotonic() + 3 * BOUND_S
        async for _ in call:
            assert worker.engine.heartbeat_age_s() < BOUND_S
            if time.monotonic() > deadline:
                call.cancel()
                break
    assert (await worker.health())[0]
