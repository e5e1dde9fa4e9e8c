"""A real decode worker and prefill worker on 127.0.0.1: disaggregated generation over
gRPC with KV pushed between them, and the local fallback when the prefill worker fails."""

import asyncio
import random
import time

import grpc
import pytest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub


def engine_config(path):
    return EngineConfig(model=str(path), num_kv_blocks=64, model_id="test-model")


async def generate(address, rid, prompt, params, prefill=None):
    async with grpc.aio.insecure_channel(address) as ch:
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))
        if prefill is not None:
            req.prefill_address, req.prefill_worker_id = prefill.address, prefill.worker_id
        chunks = [c async for c in DecodeWorkerStub(ch).Generate(req)]
    return chunks


@pytest.fixture
def prompts():
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(48)]
    return [shared + [rng.randrange(5, 1000) for _ in range(n)] for n in (5, 21)]


@pytest.mark.parametrize("kv_backend", ["grpc", "mooncake"])
async def test_disaggregated_and_fallback_match_a_single_engine(make_ckpt, prompts, kv_backend):
    path = make_ckpt("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), num_kv_blocks=64).generate(prompts, params)]
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d0", kv_backend=kv_backend), bus=bus)
    prefill = PrefillWorker(PrefillWorkerConfig(engine_config(path), worker_id="p0"), bus=bus)
    await asyncio.gather(decode.start(), prefill.start())
    try:
        assert set(await bus.live_workers()) == {"d0", "p0"}
        # 1) disaggregated: prefill on p0, KV pushed into d0's blocks, decode on d0
        chunks = await generate(decode.address, "r0", prompts[0], params, prefill)
        assert [t for c in chunks for t in c.token_ids] == expected[0]
        assert chunks[0].prefill_worker_id == "p0" and chunks[0].worker_id == "d0"
        assert chunks[0].prefill_fallback == "" and chunks[-1].finish_reason == "length"
        # 2) second prompt shares 3 blocks with the first: d0 holds them, p0 pushes only the rest
        chunks = await generate(decode.address, "r1", prompts[1], params, prefill)
        assert [t for c in chunks for t in c.token_ids] == expected[1]
        assert chunks[0].num_cached_tokens == 48
        # 3) prefill worker gone: the decode worker prefills locally, same tokens
        await prefill.stop()
        chunks = await generate(decode.address, "r2", prompts[0], params, prefill)
        assert [t for c in chunks for t in c.token_ids] == expected[0]
        assert chunks[0].prefill_worker_id == "d0" and "UNAVAILABLE" in chunks[0].prefill_fallback
        await asyncio.sleep(0.2)
        engine = decode.engine.engine
        assert engine.num_free_blocks == engine.num_total_blocks
        assert not engine.remote and not decode.receiver.in_flight()
        # KV events reached the bus: d0 published stored blocks for the shared prefix
        events = await bus.read_kv({"d0": "0-0"})
        assert any(r.event.kind == "stored" for r in events)
    finally:
        await decode.stop()


async def test_bad_requests_are_invalid_argument_and_cancel_frees_blocks(make_ckpt):
    path = make_ckpt("llama")
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d1"), bus=InProcBus())
    await decode.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(decode.address, "bad", [10**7], SamplingParams(max_tokens=3))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.details()
        bad = sampling_to_proto(SamplingParams())
        bad.top_p = 3.0
        async with grpc.aio.insecure_channel(decode.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [c async for c in DecodeWorkerStub(ch).Generate(
                    pb.GenerateRequest(request_id="x", prompt_token_ids=[5, 6], sampling=bad))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err.value.details()
            # A client that goes away mid-stream: the request is aborted and its blocks freed.
            call = DecodeWorkerStub(ch).Generate(pb.GenerateRequest(
                request_id="long", prompt_token_ids=list(range(5, 200)),
                sampling=sampling_to_proto(SamplingParams(max_tokens=800, ignore_eos=True))))
            await call.read()
            call.cancel()
        for _ in range(50):
            await asyncio.sleep(0.05)
            engine = decode.engine.engine
            if engine.num_free_blocks == engine.num_total_blocks and not decode.streams:
                break
        assert engine.num_free_blocks == engine.num_total_blocks and not engine.sequences
    finally:
        await decode.stop()


async def test_drain_only_from_loopback_and_the_drain_command(make_ckpt):
    """/drain is not on the (scraped) admin port; `splitserve drain` on the pod's loopback
    drains the worker: it leaves the registry and refuses new streams."""
    import subprocess
    import sys

    import aiohttp

    path = make_ckpt("llama")
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d-drain", admin_port=0,
                                             drain_port=0), bus=bus)
    await decode.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(decode.admin_url + "/drain") as r:
                assert r.status == 404  # not reachable where Prometheus (or anyone else) scrapes
            async with http.get(decode.admin_url + "/health") as r:
                assert r.status == 200
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "splitserve.cli", "drain", "--port", str(decode.drain_port), "--timeout", "30",
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert '"drained": true' in out.decode()
        assert "d-drain" not in await bus.live_workers()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await generate(decode.address, "late", [5, 6, 7], SamplingParams(max_tokens=2))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in exc.value.details()
        bad = subprocess.run([sys.executable, "-m", "splitserve.cli", "drain", "--port", "1"],
                             capture_output=True, text=True)
        assert bad.returncode == 1 and "cannot reach http://127.0.0.1:1/drain" in bad.stderr
    finally:
        await decode.stop()


async def test_stream_interval_groups_tokens_without_changing_them(make_ckpt, prompts):
    """--stream-interval N: the first token alone (TTFT), then N tokens per chunk, the rest with
    the finish; the tokens and logprobs are those of interval 1, in order."""
    path = make_ckpt("llama")
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2)
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d2"), bus=InProcBus())
    await decode.start()
    try:
        runs = {}
        async with grpc.aio.insecure_channel(decode.address) as ch:
            for interval in (0, 1, 4, 100):
                req = pb.GenerateRequest(request_id=f"r{interval}", prompt_token_ids=prompts[1],
                                         sampling=sampling_to_proto(params), stream_interval=interval)
                runs[interval] = [c async for c in DecodeWorkerStub(ch).Generate(req)]
    finally:
        await decode.stop()
    sizes = {k: [len(c.token_ids) for c in chunks] for k, chunks in runs.items()}
    # Unloaded: [1] * 14, [1, 4, 4, 4, 1] and [1, 13]. Outputs that piled up while the stream was
    # sending are merged into the next chunk (see the test below), so on a busy machine a chunk
    # may carry more: what must hold is the total, and no chunk but the first and last below N.
    for k, got in sizes.items():
        assert sum(got) == 14 and min(got) >= 1, (k, got)
        assert all(n >= max(k, 1) for n in got[1:-1]), (k, got)
    assert len(sizes[100]) == 2
    tokens = {k: [t for c in chunks for t in c.token_ids] for k, chunks in runs.items()}
    logprobs = {k: [(lp.token_id, lp.logprob) for c in chunks for lp in c.logprobs] for k, chunks in runs.items()}
    assert tokens[4] == tokens[100] == tokens[1] == tokens[0] and len(set(tokens[1])) > 1
    assert logprobs[4] == logprobs[100] == logprobs[1] and len(logprobs[1]) == 14
    for chunks in runs.values():  # the header rides on the first chunk, the finish on the last only
        assert chunks[0].worker_id == "d2" and chunks[0].num_prompt_tokens == len(prompts[1])
        assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]


async def test_outputs_that_piled_up_go_out_in_one_chunk(make_ckpt, prompts):
    """Steps that finished while the stream could not send (its event loop busy) are merged
    into one message, as vLLM merges outputs its consumer has not taken: fewer messages under
    load, the same tokens and logprobs in the same order."""
    path = make_ckpt("llama")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    expected = LLM(str(path), num_kv_blocks=64).generate([prompts[0]], params)[0]
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d3"), bus=InProcBus())
    await decode.start()
    try:
        chunks = []
        async with grpc.aio.insecure_channel(decode.address) as ch:
            req = pb.GenerateRequest(request_id="piled", prompt_token_ids=prompts[0], sampling=sampling_to_proto(params))
            async for c in DecodeWorkerStub(ch).Generate(req):
                chunks.append(c)
                if len(chunks) == 2:
                    time.sleep(0.5)  # the loop stalls; the engine (its own process) keeps stepping
    finally:
        await decode.stop()
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert [lp.token_id for c in chunks for lp in c.logprobs] == expected.token_ids
    assert max(len(c.token_ids) for c in chunks) > 1 and len(chunks) < 40, [len(c.token_ids) for c in chunks]
    assert [c.finish_reason for c in chunks] == [""] * (len(chunks) - 1) + ["length"]


async def test_router_leaves_a_finished_stream_to_close_itself(make_ckpt, monkeypatch):
    """After the finish chunk the router does not reset the call: the worker's handler runs to
    its end and sends the closing status (a reset racing that status had grpc log an error
    traceback on the worker for a stream that ended well). A stream the router leaves before
    its finish is still cancelled on the worker."""
    from splitserve.router.dispatch import DispatchConfig, Dispatcher
    from splitserve.router.policy import RouteDecision

    ends: dict[str, str] = {}
    original = DecodeWorker.Generate

    async def observed(self, request, context):
        rid = request.request_id
        outcome = "cancelled"  # ended before its end: cancelled mid-await, or closed at a yield
        try:
            async for chunk in original(self, request, context):
                yield chunk
            await asyncio.sleep(0.3)  # a slow path to the closing status: a reset would land here
            outcome = "completed"
        finally:
            ends[rid] = outcome

    monkeypatch.setattr(DecodeWorker, "Generate", observed)
    path = make_ckpt("llama")
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(engine_config(path), worker_id="d9"), bus=bus)
    await decode.start()
    dispatcher = Dispatcher(DispatchConfig(model_id="test-model"), bus)
    await dispatcher.start()
    try:
        await dispatcher.sync.refresh()
        decision = RouteDecision("d9", None, 4, 0, 0, 0, "test", "test")
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        events = [e async for e in dispatcher.generate("whole", [5, 6, 7, 8], params, decision)]
        assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 6
        # the consumer stops at the finish event, as the SSE writer does
        stream = dispatcher.generate("stops-at-finish", [5, 6, 7, 9], params, decision)
        async for event in stream:
            if event.finish_reason:
                break
        await stream.aclose()
        left = dispatcher.generate("left-early", [5, 6, 7, 10], SamplingParams(max_tokens=500, ignore_eos=True),
                                   decision)
        await left.__anext__()
        await left.aclose()
        for _ in range(200):
            if len(ends) == 3:
                break
            await asyncio.sleep(0.05)
        assert ends == {"whole": "completed", "stops-at-finish": "completed", "left-early": "cancelled"}
        assert not dispatcher._calls.get("d9")
    finally:
        await dispatcher.stop()
        await decode.stop()
