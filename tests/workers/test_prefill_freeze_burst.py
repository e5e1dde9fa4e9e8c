"""A prefill worker's engine frozen (SIGSTOP) during a burst of disaggregated prompts
(issue 38): every request still completes token-exact (those caught by the freeze are
prefilled locally once the decode worker's deadline passes), nothing is held on either side
after the thaw, and the worker serves again."""

from __future__ import annotations

import asyncio
import os
import random
import signal

from splitserve.cluster.inproc_bus import InProcBus
from splitserve.decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from tests.helpers.pools import kv_idle
from tests.workers.test_prefill_deadline_release import wait_for
from tests.workers.test_workers_grpc import generate

DEADLINE_S = 2.0
FROZEN_S = 4.0


def _config(path) -> EngineConfig:
    return EngineConfig(model=str(path), num_kv_blocks=256, model_id="test-model", max_num_batched_tokens=64)


async def test_a_frozen_prefill_worker_costs_a_local_prefill_and_leaves_nothing_held(make_ckpt):
    path = make_ckpt("llama")
    rng = random.Random(38)
    burst = [[rng.randrange(5, 1000) for _ in range(rng.randrange(150, 300))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(path), num_kv_blocks=256).generate(burst, params)]
    bus = InProcBus()
    decode = DecodeWorker(DecodeWorkerConfig(_config(path), worker_id="d0", prefill_timeout_s=DEADLINE_S),
                          bus=bus)
    prefill = PrefillWorker(PrefillWorkerConfig(_config(path), worker_id="p0", engine_process=True,
                                                engine_heartbeat_timeout_s=0), bus=bus)
    await asyncio.gather(decode.start(), prefill.start())
    try:
        calls = [asyncio.create_task(generate(decode.address, f"b{i}", p, params, prefill))
                 for i, p in enumerate(burst)]
        await wait_for(lambda: prefill.waiters, "the burst to reach the prefill worker")
        os.kill(prefill.engine.pid, signal.SIGSTOP)  # mid-burst: its chunked prefills stop where they are
        try:
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
        finally:
            await asyncio.sleep(max(0.0, FROZEN_S - DEADLINE_S))
            os.kill(prefill.engine.pid, signal.SIGCONT)
        for i, chunks in enumerate(results):
            assert [t for c in chunks for t in c.token_ids] == expected[i], i
        fallbacks = [c[0].prefill_fallback for c in results if c[0].prefill_fallback]
        # caught by the freeze, or refused at admission (admission.py: one step's worth is admitted blind)
        assert any("DEADLINE_EXCEEDED" in f for f in fallbacks), fallbacks
        assert all("DEADLINE_EXCEEDED" in f or "RESOURCE_EXHAUSTED" in f for f in fallbacks), fallbacks
        # after the thaw: the abandoned prefills were aborted, nothing is held or leased
        await wait_for(lambda: kv_idle(prefill.kv_state()) and kv_idle(decode.kv_state()),
                       "both pools back at idle", 30)
        assert prefill.kv_state()["held_expired"] == 0  # released by their calls, not by the sweep
        # served after the thaw (remotely, or refused at once if the freeze made the worker's
        # measured rate look too slow for the deadline: admission.py measures again later)
        again = await generate(decode.address, "after", burst[0], params, prefill)
        assert [t for c in again for t in c.token_ids] == expected[0]
        fallback = again[0].prefill_fallback
        assert fallback == "" or "RESOURCE_EXHAUSTED" in fallback, fallback
    finally:
        if prefill.engine is not None and prefill.engine.alive:
            os.kill(prefill.engine.pid, signal.SIGCONT)
        await asyncio.gather(decode.stop(), prefill.stop())
