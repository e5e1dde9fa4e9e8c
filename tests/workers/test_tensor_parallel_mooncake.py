"""Mooncake KV transfer between tensor-parallel workers (kvtransfer/segments.py): a real
prefill worker and decode worker, both at TP 2, the decode worker asking for the mooncake
backend over tcp. The prefill worker writes each block's KV heads one-sided from its rank's
pool shard into the decode rank's shard holding the same heads; the decode worker's engine
runs in its own process (as on the CPU by default), so those shards are shared memory
mapped into three processes. Greedy tokens equal transformers' (float32), the second
prompt's cached prefix is skipped, and nothing fell back to a local prefill."""

from __future__ import annotations

import asyncio
import random

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import EngineConfig, SamplingParams
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from tests.helpers.reference import hf_greedy
from tests.workers.test_workers_grpc import generate

NEW = 8


def tp2(path) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=32, model_id="test-model", tensor_parallel_size=2)


async def test_tp2_prefill_and_decode_workers_move_kv_over_mooncake_per_rank(make_ckpt):
    path = make_ckpt("llama")
    rng = random.Random(50)
    shared = [rng.randrange(5, 1000) for _ in range(32)]  # 2 full blocks of 16
    prompts = [shared + [rng.randrange(5, 1000) for _ in range(n)] for n in (7, 19)]
    want = [hf_greedy(path, p, NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(tp2(path), worker_id="d-tp", kv_backend="mooncake",
                                             engine_process=True), bus=bus)
    prefill = PrefillWorker(PrefillWorkerConfig(tp2(path), worker_id="p-tp"), bus=bus)
    await asyncio.gather(decode.start(), prefill.start())
    try:
        got, cached = [], []
        for i, prompt in enumerate(prompts):
            chunks = await generate(decode.address, f"r{i}", prompt, params, prefill)
            assert chunks[0].prefill_worker_id == "p-tp" and chunks[0].prefill_fallback == "", chunks[0]
            got.append([t for c in chunks for t in c.token_ids])
            cached.append(chunks[0].num_cached_tokens)
        assert got == want
        assert cached == [0, 32]  # the shared blocks were already on the decode worker: not pushed again
        sent = prefill.metrics.kv_transfer_bytes.labels(backend="mooncake", direction="sent")._value.get()
        assert sent > 0  # the KV went over Mooncake
        assert not decode.receiver.in_flight()
    finally:
        await prefill.stop()
        await decode.stop()
