"""DeepSeek-V3 (multi-head latent attention) on every serving path of a real cluster
(redis-server, a TP=1 prefill worker, a `-tp 2` decode worker, a router; later a TP=1 decode
worker): a prompt prefilled on the prefill worker has its latent rows pushed TP=1 -> TP=2
(the latent is replicated on every rank: each rank receives the whole row, nothing is split),
a repeated prompt is a prefix-cache hit, and streams of the TP worker, SIGKILLed mid-stream,
migrate to the TP=1 worker. Every text equals transformers' greedy continuation."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from splitserve.core.tokenizer import Tokenizer
from tests.engine.test_deepseek_v3 import write_deepseek_v3
from tests.helpers.reference import hf_greedy
from tests.reliability.cluster import Cluster
from tests.reliability.conftest import (
    StreamResult,
    assert_identical,
    complete,
    metric,
    prompts,
    stream_completion,
)

MAX = 96


@pytest.fixture()
def mla_cluster(tmp_path):
    model = write_deepseek_v3(tmp_path / "deepseek_v3")
    c = Cluster(model, tmp_path)
    c.start_redis()
    try:
        c.engine_args = [*c.engine_args, "-tp", "2"]
        c.start_decode("decode-tp")
        c.engine_args = c.engine_args[:-2]
        c.start_prefill("prefill-0")
        c.router = c.start_router()
        c.wait_registered(c.router)
        yield c
    finally:
        c.stop()


def transformers_reference(model, batch: list[list[int]], max_tokens: int) -> list[tuple[list[int], str]]:
    tok = Tokenizer(str(model))
    return [(ids, tok.decode(ids)) for ids in (hf_greedy(model, p, max_tokens) for p in batch)]


def test_mla_disaggregated_tp1_to_tp2_prefix_hit_and_migration(mla_cluster):
    c = mla_cluster
    # the start-up line says what a token costs: one latent row of 32 + 8 in 3 layers, float32, on each rank
    assert "KV blocks = 4096 tokens of float32 (480 bytes a token a rank: one latent row of 40, 3 layers)" \
        in c.decode["decode-tp"].log(), c.decode["decode-tp"].log()[-2000:]
    long_prompt = prompts(71, 1, 40)[0]  # >= 24 uncached tokens: the router asks the prefill worker
    want = transformers_reference(c.model, [long_prompt], 24)[0][1]

    async def one():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            return await complete(s, c.router.base_url, long_prompt, 24)

    status, body, headers = asyncio.run(one())
    assert status == 200, body
    assert headers["X-Splitserve-Workers"].startswith("decode=decode-tp; prefill=prefill-0;"), headers
    assert body["choices"][0]["text"] == want
    # on the wire too a token costs one latent row a layer: 3 blocks of 16 tokens x 40 x 3 layers x 4 bytes
    prefill_metrics = c.prefill["prefill-0"].match.group(2)
    sent = metric(prefill_metrics, "splitserve_kv_transfer_bytes_total", direction="sent")
    assert sent == 3 * 16 * (32 + 8) * 3 * 4, sent
    status, body, headers = asyncio.run(one())  # the same prompt again: its latent rows are cached there
    assert status == 200 and body["choices"][0]["text"] == want
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, body["usage"]
    assert headers["X-Splitserve-Workers"].startswith("decode=decode-tp;"), headers

    c.start_decode("decode-1")
    c.wait_registered(c.router)
    batch = [long_prompt[:32] + p for p in prompts(72, 2, 8)]  # its cached prefix draws them to decode-tp
    migrations = metric(c.router.base_url, "splitserve_request_migrations_total")

    async def streams():
        results = [StreamResult() for _ in batch]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            tasks = [asyncio.create_task(stream_completion(s, c.router.base_url, p, MAX, out=r))
                     for p, r in zip(batch, results, strict=True)]
            while not all(r.chunks >= 4 for r in results):
                await asyncio.sleep(0.005)
            assert any(r.decode_worker == "decode-tp" and not r.done for r in results), \
                [(r.decode_worker, r.done) for r in results]
            await asyncio.to_thread(c.decode["decode-tp"].kill)
            await asyncio.gather(*tasks)
        return results

    results = asyncio.run(streams())
    assert_identical(results, transformers_reference(c.model, batch, MAX), MAX)
    assert metric(c.router.base_url, "splitserve_request_migrations_total") - migrations >= 1
