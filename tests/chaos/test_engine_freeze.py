"""An engine process frozen (SIGSTOP) in a real `splitserve serve`, idle and then mid-stream
(issue 39). Before, an idle frozen engine kept its worker `ok` and registered for as long as
it was stopped (150 s in the report) and a third of new requests hung on it; frozen mid-step,
its streams waited for the 120 s stall timeout. Now the worker's heartbeat to its engine
process goes unanswered, the worker leaves the registry within --engine-heartbeat-timeout
plus one registry check, new requests go to the other decode worker, its streams migrate
token-exact, and after SIGCONT it registers again with every block free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
import requests

from splitserve.engine.faults import ENV
from tests.chaos.conftest import LONG_TOKENS, Serve
from tests.reliability.conftest import (
    SERVED,
    StreamResult,
    assert_identical,
    metric,
    prompts,
    stream_completion,
    wait_for,
)

BOUND_S = 2.0
TOKENS = 480
# Decode steps 10 ms longer (engine/faults.py "slow"): a 480-token stream stays open 5 s or
# more whatever the machine's speed, so the engine is still generating when the client has
# seen 4 tokens of every stream. Unslowed, the demo model's engine sometimes finished them all
# while a loaded test client was still reading (CI: nothing left to migrate).
SLOW_DECODE = [{"engine": f"decode-{i}", "fault": "slow", "at_step": 0, "step_ms": 10} for i in (0, 1)]


@pytest.fixture(scope="module")
def serve(make_ckpt, tmp_path_factory):
    s = Serve(make_ckpt("llama"), tmp_path_factory.mktemp("freeze"),
              extra_args=["--engine-heartbeat-timeout", str(BOUND_S), "--engine-loop", "process"],
              env={ENV: json.dumps(SLOW_DECODE)})
    yield s
    s.stop()


def _decode_workers(s: Serve) -> tuple:
    return tuple(s.router_health()["decode_workers"])


def _freeze(pid: int) -> float:
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic()


def test_an_idle_frozen_engine_leaves_new_requests_go_elsewhere_and_it_rejoins(serve):
    s = serve
    s.wait_recovered()
    pid = s.workers()["decode-0"].health()["engine"]["pid"]
    frozen = _freeze(pid)
    try:
        wait_for(lambda: _decode_workers(s) == ("decode-1",), 30, "decode-0 to leave the router's registry")
        left = time.monotonic() - frozen
        health = s.workers()["decode-0"].health()
        assert health["status"] == "engine_unhealthy" and "has not answered a heartbeat" in health["detail"]
        assert requests.get(s.workers()["decode-0"].admin + "/livez", timeout=5).status_code == 503
        served_by = []
        for p in prompts(701, 6, 24):  # nothing hangs: every request is served by decode-1
            r = requests.post(s.base_url + "/v1/completions", timeout=60, json={
                "model": SERVED, "prompt": p, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            served_by.append(r.headers["x-splitserve-workers"].split(";")[0])
        assert set(served_by) == {"decode=decode-1"}, served_by
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: set(_decode_workers(s)) == {"decode-0", "decode-1"}, 30, "decode-0 to register again")
    print(f"idle freeze: decode-0 out of the registry {left:.1f} s after SIGSTOP (bound {BOUND_S} s)")
    s.wait_recovered()


def test_streams_on_an_engine_frozen_mid_step_migrate_token_exact(serve, reference):
    s = serve
    s.wait_recovered()
    batch = prompts(702, 4, 24) + prompts(703, 4, LONG_TOKENS)
    pids = {wid: w.health()["engine"]["pid"] for wid, w in s.workers().items() if w.role == "decode"}
    outs: list = [None] * len(batch)
    victim: list[int] = []
    frozen_at: list[float] = []

    migrations = metric(s.base_url, "splitserve_request_migrations_total")

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=100)) as session:
            for i in range(len(batch)):
                outs[i] = StreamResult()
            tasks = [asyncio.create_task(stream_completion(session, s.base_url, p, TOKENS, out=outs[i]))
                     for i, p in enumerate(batch)]
            while not all(len(o.tokens) >= 4 for o in outs):
                await asyncio.sleep(0.02)
            # the decode worker of the stream least far along: still running, so it is frozen mid-step
            # (on a loaded machine the first short stream may already have finished)
            worker = min((o for o in outs if not o.done), key=lambda o: len(o.tokens)).decode_worker
            victim.append(pids[worker])
            frozen_at.append(_freeze(victim[0]))
            return await asyncio.gather(*tasks)

    try:
        started = time.monotonic()
        results = asyncio.run(go())
        took = time.monotonic() - started
    finally:
        for pid in victim:
            os.kill(pid, signal.SIGCONT)
    assert_identical(results, reference(batch, TOKENS), TOKENS)
    assert metric(s.base_url, "splitserve_request_migrations_total") > migrations  # its streams moved
    assert took < 60, f"the streams took {took:.0f} s: they waited for the stall timeout, not the heartbeat"
    print(f"mid-step freeze: {len(batch)} streams finished token-exact {took:.1f} s after they started")
    s.wait_recovered()  # thawed: the migrated requests' aborts ran, every block is free
