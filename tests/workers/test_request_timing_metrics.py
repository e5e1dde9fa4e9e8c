"""A decode worker exports where its first tokens' time went: one queue-time and one
prefill-time observation per request it prefilled, whether its engine loop is a thread or
a process of its own (the timings cross the pipe with the first token)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub


async def generate(stub, rid: str, prompt: list[int]) -> int:
    call = stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                            sampling=sampling_to_proto(SamplingParams(max_tokens=4, ignore_eos=True))))
    return sum([len(chunk.token_ids) async for chunk in call])


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
async def test_each_request_prefilled_here_is_one_queue_and_one_prefill_observation(make_ckpt, engine_process):
    worker = DecodeWorker(DecodeWorkerConfig(EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=64,
                                                          max_num_batched_tokens=32, model_id="test-model"),
                                             worker_id="d-timing", admin_port=0, engine_process=engine_process),
                          bus=InProcBus())
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            stub = DecodeWorkerStub(ch)
            prompts = [list(range(5, 5 + n)) for n in (60, 20, 8)]  # the budget of 32 makes them queue
            assert await asyncio.gather(*(generate(stub, f"r{i}", p) for i, p in enumerate(prompts))) == [4, 4, 4]
        registry, labels = worker.metrics.registry, {"role": "decode", "worker": "d-timing"}
        sample = registry.get_sample_value
        assert sample("splitserve_request_queue_time_seconds_count", labels) == 3
        assert sample("splitserve_request_prefill_time_seconds_count", labels) == 3
        assert sample("splitserve_request_prefill_time_seconds_sum", labels) > 0  # a forward pass takes time
    finally:
        await worker.stop()
