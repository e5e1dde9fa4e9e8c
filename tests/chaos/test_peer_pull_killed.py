"""A peer decode worker killed (SIGKILL) in the middle of pushing a prefix to the worker that
pulls it: the puller's KV receiver sees the stream break, the pull fails, the blocks go back
once no write can land in them, and the prefix is recomputed: the same tokens as an engine
that never pulled, every block and lease back at idle. The peer is a real `splitserve
decode-worker` process on a real Redis; the blocks are half a megabyte each (a wide random
model), so the 128-block push lasts long enough to be cut."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
from prometheus_client import generate_latest

from splitserve.cluster.redis_bus import RedisBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.proto.convert import pb, sampling_to_proto
from splitserve.proto.worker_pb2_grpc import DecodeWorkerStub
from tests.helpers.processes import free_port, start_redis

SERVED = "pull-chaos"
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BLOCKS = 256
rng = random.Random(17)
PREFIX = [rng.randrange(5, 1000) for _ in range(2048)]  # 128 blocks of 512 KiB
PROMPT = PREFIX + [rng.randrange(5, 1000) for _ in range(9)]


def start_peer(model, redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "decode-worker", "--model", str(model),
                             "--served-model-name", SERVED, "--num-kv-blocks", str(BLOCKS), "--port", str(port),
                             "--admin-port", "0", "--drain-port", "0", "--worker-id", "peer", "--redis-url", redis_url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    ready, lines = threading.Event(), []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "serving gRPC on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(120) and proc.poll() is None, "".join(lines[-40:])
    return proc, f"127.0.0.1:{port}"


async def generate(address: str, rid: str, prompt: list[int], pull_address: str = "") -> list[int]:
    req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(PARAMS))
    if pull_address:
        req.pull_worker_id, req.pull_address, req.pull_blocks = "peer", pull_address, len(PREFIX) // 16
    async with grpc.aio.insecure_channel(address) as ch:
        return [t for c in [c async for c in DecodeWorkerStub(ch).Generate(req, timeout=300)] for t in c.token_ids]


async def kill_mid_push(puller: DecodeWorker, peer: subprocess.Popen) -> int:
    """SIGKILL the peer once the puller's receiver has some, not all, of the pulled bytes."""
    while True:
        lease = puller.receiver.in_flight().get("pull/pull")
        if lease and lease["bytes_received"] > 0:
            os.killpg(peer.pid, signal.SIGKILL)
            return lease["bytes_received"]
        await asyncio.sleep(0.0005)


async def test_a_peer_killed_mid_pull_leaves_a_recompute_with_the_same_tokens(make_ckpt, tmp_path):
    model = make_ckpt("llama", hidden_size=512, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=8)
    with LLM(str(model), num_kv_blocks=BLOCKS) as llm:
        want = llm.generate(PROMPT, PARAMS)[0].token_ids
    redis_url, redis_proc = start_redis(tmp_path)
    peer, peer_address = start_peer(model, redis_url)
    puller = DecodeWorker(DecodeWorkerConfig(EngineConfig(model=str(model), num_kv_blocks=BLOCKS, model_id=SERVED),
                                             worker_id="puller", prefill_timeout_s=30), bus=RedisBus(redis_url, "local"))
    try:
        await puller.start()
        assert await generate(peer_address, "warm", PROMPT) == want  # the peer holds the prefix now
        pull = asyncio.create_task(generate(puller.address, "pull", PROMPT, pull_address=peer_address))
        received = await asyncio.wait_for(kill_mid_push(puller, peer), timeout=120)
        assert await pull == want
        assert 0 < received < len(PREFIX) // 16 * puller.engine.engine.kv_pool.spec.block_nbytes
        text = generate_latest(puller.metrics.registry).decode()
        assert 'splitserve_kv_peer_pull_requests_total{outcome="failed",worker="puller"} 1.0' in text
        assert 'splitserve_kv_peer_pull_blocks_total{direction="pulled",worker="puller"}' not in text
        deadline = time.monotonic() + 30
        engine = puller.engine.engine
        while engine.num_free_blocks != engine.num_total_blocks or puller.receiver.in_flight():
            assert time.monotonic() < deadline, (engine.num_free_blocks, puller.receiver.in_flight())
            await asyncio.sleep(0.1)
        assert not puller.receiver.leases.reserved_blocks
    finally:
        await puller.stop()
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
        peer.wait()
        redis_proc.terminate()
        redis_proc.wait(timeout=10)
