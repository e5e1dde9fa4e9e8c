"""Clients that hang up mid-stream by the hundred, as behind a load balancer: each opens a
streaming request and resets the TCP connection (SO_LINGER 0) 0-150 ms later, while 12
other streams run. Before the fix this killed the engine thread of every decode worker
(and the prefill worker's, with long prompts): every later request hung, /health said ok.

Each of the 12 stream slots re-runs its prompt until the storm has ended, so the storm always
meets a busy server however fast or slow the machine is (a fixed stream length once finished
before a slow CI machine's storm did). Afterwards: every stream run was token-exact, 8 new requests (short and long) complete
token-exact, every engine is alive, every KV block is free, and the router
answered no 5xx."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import aiohttp

from tests.chaos.conftest import LONG_TOKENS, SERVED
from tests.reliability.conftest import (
    StreamResult,
    assert_identical,
    prompts,
    stream_completion,
    wait_for,
)

RESETS = int(os.environ.get("SPLITSERVE_CHAOS_RESETS", "100"))  # `make chaos` runs 1,000
STREAMS = 12
STREAM_TOKENS = 256


def reset_after_send(base_url: str, body: dict, delay: float) -> None:
    """POST a streaming request, wait `delay`, then close with RST instead of FIN."""
    url = urlparse(base_url)
    data = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(delay)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def storm(base_url: str, n: int, seed: int) -> int:
    """`n` abrupt resets, a third of them with prompts long enough for the prefill worker."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        length = LONG_TOKENS + rng.randrange(64) if i % 3 == 0 else rng.randrange(8, 40)
        bodies.append(({"model": SERVED, "prompt": [rng.randrange(5, 1000) for _ in range(length)],
                        "max_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True},
                       rng.uniform(0.0, 0.15)))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda bd: reset_after_send(base_url, *bd), bodies))
    return n


def test_client_reset_storm_leaves_every_engine_alive_and_every_block_free(serve, reference):
    base = serve.base_url
    errors_before = serve.server_errors()
    running = prompts(301, STREAMS // 2, 24) + prompts(302, STREAMS // 2, LONG_TOKENS)
    after = prompts(303, 4, 20) + prompts(304, 4, LONG_TOKENS + 8)

    async def keep_streaming(s, prompt, storm_over: asyncio.Event, runs: list[StreamResult]):
        """Stream `prompt` again and again until the storm is over, the last run outlasting it."""
        while True:
            runs.append(StreamResult())
            await stream_completion(s, base, prompt, STREAM_TOKENS, out=runs[-1])
            if storm_over.is_set():
                return

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            storm_over = asyncio.Event()
            runs: list[list[StreamResult]] = [[] for _ in running]
            tasks = [asyncio.create_task(keep_streaming(s, p, storm_over, r)) for p, r in zip(running, runs, strict=True)]
            await asyncio.to_thread(wait_for, lambda: all(r and r[0].chunks >= 2 for r in runs), 60,
                                    "12 streams running")
            started = time.monotonic()
            await asyncio.to_thread(storm, base, RESETS, 7)
            storm_s = time.monotonic() - started
            in_flight = sum(not r[-1].done for r in runs)
            storm_over.set()
            await asyncio.gather(*tasks)
            t0 = time.monotonic()
            # no clock here: a hung engine leaves these to the session's 300 s client timeout
            fresh = await asyncio.gather(*(stream_completion(s, base, p, 24) for p in after))
            return runs, fresh, storm_s, in_flight, time.monotonic() - t0

    runs, fresh, storm_s, in_flight, fresh_s = asyncio.run(go())
    print(f"reset storm: {RESETS} resets in {storm_s:.1f}s; {sum(map(len, runs))} stream runs in 12 slots, "
          f"{in_flight} in flight at its end; 8 new requests took {fresh_s:.1f}s")
    expected = reference(running, STREAM_TOKENS)
    for slot_runs, want in zip(runs, expected, strict=True):
        assert_identical(slot_runs, [want] * len(slot_runs), STREAM_TOKENS)
    assert_identical(fresh, reference(after, 24), 24)
    assert any(r.route and "prefill=prefill-0" in r.route for r in fresh), "no new long prompt was disaggregated"

    healths = serve.wait_recovered(timeout=60)
    assert {h["engine"]["step_failures"] for h in healths.values()} == {0}, healths
    router = serve.router_health()
    assert router["status"] == "ok" and router["admission"]["in_flight"] == 0, router
    assert serve.server_errors() == errors_before
    log = serve.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:5000]
