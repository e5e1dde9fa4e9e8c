"""Peer prefix pull between two real decode workers on 127.0.0.1 (gRPC; the KV over the grpc
or the mooncake backend): the worker told that a peer holds the prompt's prefix pulls those
blocks instead of recomputing them, token-exact; a peer that lacks them or is gone ends in a
recompute with the same tokens; every block and lease is back at idle."""

import asyncio
import random

import grpc
import pytest
from prometheus_client import generate_latest

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
rng = random.Random(9)
PREFIX = [rng.randrange(5, 1000) for _ in range(96)]  # 6 blocks
FIRST, SECOND = PREFIX + [7, 8, 9], PREFIX + [rng.randrange(5, 1000) for _ in range(11)]


def config(path, worker_id, kv_backend="grpc"):
    return DecodeWorkerConfig(EngineConfig(model=str(path), num_kv_blocks=64, model_id="test-model"),
                              worker_id=worker_id, prefill_timeout_s=10, kv_backend=kv_backend)


async def generate(worker, rid, prompt, pull_from=None, pull_blocks=6):
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS))
    if pull_from is not None:
        req.pull_worker_id, req.pull_address, req.pull_blocks = pull_from.worker_id, pull_from.address, pull_blocks
    async with grpc.aio.insecure_channel(worker.address) as ch:
        chunks = [c async for c in DecodeWorkerStub(ch).Generate(req)]
    return [t for c in chunks for t in c.token_ids], chunks[0].num_cached_tokens


def metric(worker, name, **labels) -> float:
    text = generate_latest(worker.metrics.registry).decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "worker": worker.worker_id}.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    return 0.0


async def assert_idle(*workers):
    await asyncio.sleep(0.2)
    for w in workers:
        engine = w.engine.engine
        assert engine.num_free_blocks == engine.num_total_blocks, w.worker_id
        assert not w.receiver.in_flight() and not w.receiver.leases.reserved_blocks


@pytest.fixture
def expected(make_ckpt):
    with LLM(str(make_ckpt("llama")), num_kv_blocks=64) as llm:
        return {tuple(p): o.token_ids for p, o in zip((FIRST, SECOND), llm.generate([FIRST, SECOND], PARAMS),
                                                      strict=True)}


@pytest.mark.parametrize("kv_backend", ["grpc", "mooncake"])
async def test_the_prefix_is_pulled_from_the_peer_token_exact(make_ckpt, expected, kv_backend):
    path, bus = make_ckpt("llama"), InProcBus()
    d0, d1 = (DecodeWorker(config(path, w, kv_backend), bus=bus) for w in ("d0", "d1"))
    await asyncio.gather(d0.start(), d1.start())
    try:
        assert await generate(d0, "a", FIRST) == (expected[tuple(FIRST)], 0)
        tokens, cached = await generate(d1, "b", SECOND, pull_from=d0)
        assert tokens == expected[tuple(SECOND)]
        assert cached == 96  # the pulled blocks were a prefix-cache hit at admission
        assert metric(d1, "splitserve_kv_peer_pull_blocks_total", direction="pulled") == 6
        assert metric(d0, "splitserve_kv_peer_pull_blocks_total", direction="pushed") == 6
        assert metric(d1, "splitserve_kv_peer_pull_requests_total", outcome="ok") == 1
        # pulled again: d1 holds the prefix itself now, nothing to pull
        assert await generate(d1, "c", SECOND, pull_from=d0) == (expected[tuple(SECOND)], 96)
        assert metric(d1, "splitserve_kv_peer_pull_requests_total", outcome="skipped") == 1
        await assert_idle(d0, d1)
    finally:
        await asyncio.gather(d0.stop(), d1.stop())


async def test_a_peer_without_the_blocks_or_gone_means_a_recompute_with_the_same_tokens(make_ckpt, expected):
    path, bus = make_ckpt("llama"), InProcBus()
    d0, d1 = DecodeWorker(config(path, "d0"), bus=bus), DecodeWorker(config(path, "d1"), bus=bus)
    await asyncio.gather(d0.start(), d1.start())
    try:
        # d0 never saw the prompt: it refuses (NOT_FOUND), d1 recomputes
        assert await generate(d1, "a", SECOND, pull_from=d0) == (expected[tuple(SECOND)], 0)
        assert metric(d1, "splitserve_kv_peer_pull_requests_total", outcome="failed") == 1
        await generate(d0, "b", FIRST)
        await d0.stop()  # the peer is gone by the time d1 asks
        assert await generate(d1, "c", FIRST, pull_from=d0) == (expected[tuple(FIRST)], 96)  # d1 cached it in "a"
        d1.engine.engine.scheduler.bm.reset_prefix_cache()
        assert await generate(d1, "d", FIRST, pull_from=d0) == (expected[tuple(FIRST)], 0)
        assert metric(d1, "splitserve_kv_peer_pull_requests_total", outcome="failed") == 2
        await assert_idle(d1)
    finally:
        await asyncio.gather(d0.stop(), d1.stop())
