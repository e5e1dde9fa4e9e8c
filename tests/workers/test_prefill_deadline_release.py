"""A Prefill whose caller gives up while the prompt is still being computed (the decode
worker's deadline, a burst behind a slow or frozen prefill worker) leaves nothing held.

Reproduced first through `splitserve serve` (24 concurrent 1,700-token prompts, the prefill
worker frozen 40 s): every request completed by local fallback, and the prefill worker kept
17 requests and 1,819 blocks held for a push nobody would make, still after 40 s idle.
Here the engine thread is gated so the order is fixed, not timed: the prompt's first chunk
is in the engine when the RPC's deadline passes, the handler's clean-up is queued behind
it, and only then do the steps go on."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import PrefillWorkerStub

PROMPT = list(range(5, 69))  # 64 tokens: four chunks of the 16-token step budget below


async def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_prefill_abandoned_mid_prompt_is_aborted_not_held(make_ckpt):
    cfg = EngineConfig(model=str(make_ckpt("llama")), num_kv_blocks=64, max_num_batched_tokens=16,
                       model_id="test-model")
    worker = PrefillWorker(PrefillWorkerConfig(cfg, worker_id="p0", engine_process=False), bus=InProcBus())
    await worker.start()
    engine = worker.engine.engine  # the LLMEngine, stepped on the engine thread
    gate, in_step = threading.Event(), threading.Event()
    step = engine.step

    def gated_step():
        in_step.set()
        gate.wait(60)
        return step()

    engine.step = gated_step
    try:
        request = pb.PrefillRequest(request_id="abandoned", prompt_token_ids=PROMPT,
                                    sampling=sampling_to_proto(SamplingParams(temperature=0, max_tokens=8)),
                                    kv_receiver_address="127.0.0.1:1", kv_backend="grpc",
                                    dest_block_ids=list(range(4)), timeout_s=5)
        async with grpc.aio.insecure_channel(worker.address) as channel:
            call = PrefillWorkerStub(channel).Prefill(request, timeout=1.0)
            await asyncio.to_thread(in_step.wait, 60)  # the first chunk is in the engine
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_for(lambda: not worker.waiters, "the handler to run its clean-up")
        gate.set()  # the remaining chunks, with the clean-up's calls between steps
        await wait_for(lambda: not engine.has_unfinished_requests() and worker.engine.stats.sequences == 0,
                       "the engine to go idle")
        await asyncio.sleep(0.1)  # a last step's stats
        stats = worker.engine.stats
        assert (stats.held_for_push, stats.free_blocks) == (0, stats.total_blocks), stats
        assert not engine.held
    finally:
        gate.set()
        await worker.stop()
