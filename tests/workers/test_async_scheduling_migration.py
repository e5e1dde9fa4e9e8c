"""A stream on overlapped decode steps (--async-scheduling) migrated mid-stream resumes
token-exact: two real decode workers with overlap on 127.0.0.1 behind the router's
Dispatcher, the first failing a step (fault injection) while a step is in flight; the stream
the client gets, greedy and seeded, equals an in-process synchronous engine's, and the second
worker overlapped its steps on the resumed request. Then the same prompt again on the second
worker: a prefix hit, with overlap, the same tokens."""

import asyncio
import json

import pytest

from splitserve.engine import LLM, EngineConfig, SamplingParams
from splitserve.engine.faults import ENV
from tests.helpers.migration_pair import migration_pair, to

PROMPT = [(29 * j) % 700 + 30 for j in range(40)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=8, seed=123, max_tokens=40, ignore_eos=True),
], ids=["greedy", "seeded"])
async def test_an_overlapped_stream_migrates_token_exact_then_hits_the_prefix(make_ckpt, monkeypatch, params):
    monkeypatch.setenv(ENV, json.dumps([{"engine": "d-fail", "fault": "raise", "at_step": 8}]))
    path = str(make_ckpt("llama"))
    want = LLM(path, num_kv_blocks=64).generate(PROMPT, params)[0].token_ids
    async with migration_pair(EngineConfig(model=path, num_kv_blocks=64, async_scheduling=True)) as (dispatcher,
                                                                                                  workers):
        events = [e async for e in dispatcher.generate("r", PROMPT, params, to("d-fail"))]
        failed_overlapped = workers[0].stats.overlapped_steps
        resumed_overlapped = workers[1].stats.overlapped_steps
        again = [e async for e in dispatcher.generate("r2", PROMPT, params, to("d-ok"))]
        for _ in range(100):  # the stats snapshot follows the step that freed the blocks
            free = [(w.stats.free_blocks, w.stats.total_blocks) for w in workers]
            if all(f == t for f, t in free):
                break
            await asyncio.sleep(0.05)
    assert [e.decode_worker for e in events if e.decode_worker] == ["d-fail", "d-ok"]  # it did migrate
    moved = next(i for i, e in enumerate(events) if e.decode_worker == "d-ok")
    # steps 0-7 ran (prefill, then decode steps each returning the previous one's token): 7
    # tokens out, the 8th in flight when step 8 failed, dropped and made again on d-ok
    assert sum(len(e.token_ids) for e in events[:moved]) == 7
    assert [t for e in events for t in e.token_ids] == want
    assert failed_overlapped > 0 and resumed_overlapped > 0  # both ran the overlapped path
    # the resumed request's blocks (prompt + the first part, recomputed there) are cached on d-ok
    assert [t for e in again for t in e.token_ids] == want
    assert again[0].num_cached_tokens >= 32
    assert all(f == t for f, t in free), free  # nothing leaked on either worker
