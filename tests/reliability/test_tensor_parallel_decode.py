"""A tensor-parallel decode worker (`decode-worker -tp 2`, two rank processes over gloo) in a
disaggregated cluster of real processes (redis-server, a TP=1 prefill worker, a TP=1 decode
worker, a router): a request the router sends through the prefill worker is prefilled there
and its KV pushed TP=1 -> TP=2 (re-sharded by KV heads on arrival) with the same tokens;
SIGKILLed mid-stream, its streams migrate to the TP=1 worker token for token, and its rank
process goes with it."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from tests.reliability.cluster import Cluster
from tests.reliability.conftest import (
    StreamResult,
    assert_identical,
    complete,
    prompts,
    stream_completion,
)

MAX = 120


@pytest.fixture()
def tp_cluster(make_ckpt, tmp_path):
    c = Cluster(make_ckpt("llama"), tmp_path)
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


def rank_pids(parent_group: int) -> list[int]:
    """The processes of a worker's process group that are tensor-parallel ranks."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != parent_group:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.spawn" in f.read():
                    out.append(int(pid))
        except (OSError, ProcessLookupError):
            pass
    return out


def test_tp_decode_worker_prefills_locally_and_its_streams_migrate(tp_cluster, reference):
    c = tp_cluster
    log = c.decode["decode-tp"].log()
    assert "tensor-parallel engine: 2 ranks over gloo" in log and "KV receiver 127.0.0.1:" in log, log[-2000:]
    long_prompt = prompts(61, 1, 40)[0]  # >= 24 uncached tokens: the router asks the prefill worker

    async def one():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            return await complete(s, c.router.base_url, long_prompt, 24)

    status, body, headers = asyncio.run(one())
    assert status == 200, body
    # routed through prefill-0 and prefilled there: its KV pushed into the TP worker's ranks
    assert headers["X-Splitserve-Route"].startswith("decode=decode-tp; prefill=prefill-0;"), headers
    assert headers["X-Splitserve-Workers"].startswith("decode=decode-tp; prefill=prefill-0;"), headers
    assert body["choices"][0]["text"] == reference([long_prompt], 24)[0][1]

    c.start_decode("decode-1")
    c.wait_registered(c.router)
    batch = [long_prompt[:32] + p for p in prompts(62, 2, 8)]  # its cached prefix draws them to decode-tp
    group = os.getpgid(c.decode["decode-tp"].proc.pid)
    assert len(rank_pids(group)) >= 2  # the engine process and its rank 1

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
    assert_identical(results, reference(batch, MAX), MAX)
    deadline = time.monotonic() + 20
    while rank_pids(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rank_pids(group) == []  # no rank outlives its worker
