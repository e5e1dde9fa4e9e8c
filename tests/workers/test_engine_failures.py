"""A decode worker whose engine hangs in a step (a wedged kernel): it tells the truth on
/health and /livez, leaves the registry so routers migrate its streams, and once stuck
for twice --engine-stall-timeout gives itself up (`fatal`), so its process is replaced; and
one whose step raises sends the tokens made before it ahead of the error."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.engine.faults import ENV, release_hangs
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub

STALL_S = 0.4


async def health(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
async def test_a_hung_engine_step_is_reported_withdrawn_then_given_up(make_ckpt, monkeypatch, engine_process):
    monkeypatch.setenv(ENV, json.dumps([{"engine": "d-stall", "fault": "hang", "at_step": 3}]))
    bus = InProcBus()
    worker = DecodeWorker(DecodeWorkerConfig(EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=64,
                                                          model_id="test-model"),
                                             worker_id="d-stall", admin_port=0, heartbeat_ttl_s=0.9,
                                             engine_stall_timeout_s=STALL_S, engine_process=engine_process),
                          bus=bus)
    await worker.start()
    try:
        status, body = await health(worker.admin_url + "/health")
        assert status == 200 and body["status"] == "ok" and body["engine"]["alive"], body
        async with grpc.aio.insecure_channel(worker.address) as ch:
            call = DecodeWorkerStub(ch).Generate(pb.GenerateRequest(
                request_id="r", prompt_token_ids=list(range(5, 40)),
                sampling=sampling_to_proto(SamplingParams(max_tokens=50, ignore_eos=True))))
            await call.read()  # the stream runs; at step 3 the engine hangs
            await asyncio.sleep(STALL_S + 0.1)
            status, body = await health(worker.admin_url + "/health")
            assert status == 503 and body["status"] == "engine_unhealthy" and "stalled" in body["detail"], body
            status, body = await health(worker.admin_url + "/livez")
            assert status == 503, body  # liveness too: Kubernetes restarts a wedged worker
            await asyncio.wait_for(worker.fatal.wait(), 5)  # past 2 x the stall timeout: given up
            assert worker.failed.startswith("engine stalled") and "d-stall" not in await bus.live_workers()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while True:
                    await asyncio.wait_for(call.read(), 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "stalled" in err.value.details()
    finally:
        release_hangs()
        await worker.stop()


async def test_tokens_made_before_a_failed_step_reach_the_router_before_the_error(make_ckpt, monkeypatch):
    """Tokens the stream had not sent yet (held for --stream-interval, or merged while it was
    busy) go out before the failure: the router resumes after them. Before, the error won and
    they were lost, so a stream migrated from its start ("failed after 0 tokens")."""
    monkeypatch.setenv(ENV, json.dumps([{"engine": "d-raise", "fault": "raise", "at_step": 6}]))
    path = str(make_ckpt("llama"))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = list(range(5, 40))
    want = LLM(path, num_kv_blocks=64).generate(prompt, params)[0].token_ids
    worker = DecodeWorker(DecodeWorkerConfig(EngineConfig(model=path, num_kv_blocks=64, model_id="test-model"),
                                             worker_id="d-raise"), bus=InProcBus())
    await worker.start()
    try:
        async with grpc.aio.insecure_channel(worker.address) as ch:
            call = DecodeWorkerStub(ch).Generate(pb.GenerateRequest(
                request_id="r", prompt_token_ids=prompt, sampling=sampling_to_proto(params), stream_interval=16))
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for chunk in call:
                    chunks.append(chunk)
    finally:
        await worker.stop()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "injected step failure" in err.value.details()
    # steps 0-5 ran (prefill, then 5 decode steps): the header chunk, then what was held back for
    # the 16-token interval. Usually [1, 5]; a loaded machine can merge the second token into the
    # header chunk while it is being sent ([2, 4]). Either way all 6 arrive before the error (the
    # bug sent [1] and lost the rest).
    assert len(chunks) == 2 and len(chunks[0].token_ids) >= 1, [len(c.token_ids) for c in chunks]
    assert chunks[0].worker_id == "d-raise" and not chunks[1].worker_id
    assert [t for c in chunks for t in c.token_ids] == want[:6]
