"""A stream of each 2026 family migrates when its decode worker dies: real processes
(redis-server, two decode workers, a router), the serving worker SIGKILLed mid-stream, the
router re-prefills prompt + tokens so far on the other worker and the client's text is exactly
transformers' greedy continuation. DeepSeek-V3 has its own cluster test with TP and a prefill
worker (test_mla_disaggregated.py); here GLM-4.5, MiniMax-M2, DeepSeek-V3.2 and GLM-5, whose
prompts pass the indexer's top-k of 16 so the migrated prefill runs sparse attention, and
gpt-oss (sinks; the re-prefilled prompt + tokens far past its 8-token window)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from splitserve.core.tokenizer import Tokenizer
from tests.engine.test_deepseek_v32 import write_deepseek_v32
from tests.engine.test_glm4_moe import write_glm4_moe
from tests.engine.test_glm_moe_dsa import write_glm_moe_dsa
from tests.engine.test_gpt_oss import write_gpt_oss
from tests.engine.test_minimax_m2 import write_minimax_m2
from tests.helpers.reference import hf_greedy
from tests.reliability.cluster import Cluster
from tests.reliability.conftest import (
    StreamResult,
    assert_identical,
    metric,
    prompts,
    stream_completion,
)

MAX = 64
WRITERS = {"glm4_moe": write_glm4_moe, "minimax_m2": write_minimax_m2, "deepseek_v32": write_deepseek_v32,
           "glm_moe_dsa": write_glm_moe_dsa, "gpt_oss": write_gpt_oss}


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_stream_migrates_token_exact(tmp_path, family):
    model = WRITERS[family](tmp_path / family)
    c = Cluster(model, tmp_path, decode_step_ms=40.0)  # a 64-token stream lasts >= 2.5 s: the kill lands mid-way
    c.start_redis()
    try:
        c.start_decode("decode-0")
        c.start_decode("decode-1")
        c.router = c.start_router()
        c.wait_registered(c.router)
        prompt = prompts(81, 1, 24)[0]  # past the top-k of 16 (DSA families)
        migrations = metric(c.router.base_url, "splitserve_request_migrations_total")

        async def stream() -> StreamResult:
            result = StreamResult()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                task = asyncio.create_task(stream_completion(s, c.router.base_url, prompt, MAX, out=result))
                while result.chunks < 4:
                    await asyncio.sleep(0.005)
                assert not result.done
                await asyncio.to_thread(c.decode[result.decode_worker].kill)
                await task
            return result

        result = asyncio.run(stream())
        ids = hf_greedy(model, prompt, MAX)
        assert_identical([result], [(ids, Tokenizer(str(model)).decode(ids))], MAX)
        assert metric(c.router.base_url, "splitserve_request_migrations_total") - migrations == 1
    finally:
        c.stop()
