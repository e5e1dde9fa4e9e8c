"""`splitserve serve -tp 2` disaggregated (issue 32): every worker's engine runs two rank
processes over gloo, and KV moves between tensor-parallel workers (each rank's heads
gathered on the prefill side, scattered by head ranges on the decode side).

- long prompts go through the prefill worker, their KV is pushed TP=2 -> TP=2, and the
  greedy tokens equal a one-process engine's; again with a prefix-cache hit on the decode
  side (only the blocks it lacks are pushed), for a dense GQA model and a MoE model;
- SIGKILL one rank process of a decode worker mid-stream: its engine fails at the next
  step (the collective with the dead rank fails within milliseconds), the worker leaves the
  registry, its streams migrate token-exact to the other decode worker, and Ray restarts
  the worker with a new engine process and its rank;
- SIGSTOP one rank process of a decode worker under 6 streams (issue 49): the rank stops
  beating, the worker leaves the registry within --engine-heartbeat-timeout, its streams
  migrate token-exact, new requests go to the other decode worker, and after SIGCONT the
  same engine (nothing restarted) registers again with every block free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import aiohttp
import pytest
import requests

from splitserve.core.tokenizer import Tokenizer
from splitserve.engine import LLM, SamplingParams
from tests.chaos.conftest import LONG_TOKENS, Serve
from tests.reliability.conftest import (
    StreamResult,
    assert_identical,
    complete,
    metric,
    prompts,
    served_by,
    stream_completion,
)

TOKENS = 96
NEW = 16
HEARTBEAT_S = 3.0  # --engine-heartbeat-timeout: a frozen rank is seen within it (default 10 s)


# Decode steps 8 ms longer (engine/faults.py "slow"): a 96-token stream stays open ~0.8 s
# whatever the machine's speed, so the kill lands mid-stream (on this machine's faster CPU
# decode the streams had all ended by the time each had shown 4 chunks).
SLOW_DECODE = [{"engine": f"decode-{i}", "fault": "slow", "at_step": 0, "step_ms": 8} for i in (0, 1)]


@pytest.fixture(scope="module")
def tp_serve(make_ckpt, tmp_path_factory):
    s = Serve(make_ckpt("llama"), tmp_path_factory.mktemp("tp-serve"), extra_args=["-tp", "2", "--engine-heartbeat-timeout", str(HEARTBEAT_S)],
              env={"SPLITSERVE_FAULT_INJECTION": json.dumps(SLOW_DECODE)})
    yield s
    s.stop()
    assert s.proc.proc.returncode == 0, s.log()[-3000:]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":  # fields[1]: the parent's pid
            found.append(int(stat.parent.name))
    return found


def through_prefill_worker(base: str, batch: list[list[int]]) -> list[tuple[dict, dict]]:
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
            return await asyncio.gather(*(complete(s, base, p, NEW) for p in batch))

    out = []
    for status, body, headers in asyncio.run(go()):
        assert status == 200, body
        out.append((body, served_by(headers)))
    return out


def check_pushed_and_cached(base: str, batch: list[list[int]], want: list[str]) -> None:
    """The batch and then a prompt sharing the first one's prefix: each prefilled on
    prefill-0 and pushed (the hit pushing only the blocks after the cached ones)."""
    tail = prompts(3203, 1, LONG_TOKENS // 2)[0]
    hit = batch[0][:128] + tail
    results = through_prefill_worker(base, batch)
    results += through_prefill_worker(base, [hit])
    for (body, workers), text in zip(results, [*want[:len(batch)], want[-1]], strict=True):
        assert workers["prefill"] == "prefill-0", workers  # computed there, its KV pushed
        assert body["choices"][0]["text"] == text
    assert results[-1][0]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_kv_moves_between_tp2_workers_token_exact_with_a_prefix_hit(tp_serve, reference):
    batch = prompts(3201, 2, LONG_TOKENS)
    hit = batch[0][:128] + prompts(3203, 1, LONG_TOKENS // 2)[0]
    want = [text for _, text in reference([*batch, hit], NEW)]
    check_pushed_and_cached(tp_serve.base_url, batch, want)
    log = tp_serve.log()
    assert log.count("tensor-parallel engine: 2 ranks over gloo") >= 3, log[-3000:]


def test_a_killed_rank_takes_its_worker_down_and_its_streams_migrate(tp_serve, reference):
    s = tp_serve
    base = s.base_url
    batch = prompts(3204, 4, LONG_TOKENS)
    migrations = metric(base, "splitserve_request_migrations_total")
    registered: list[list[str]] = []  # the router's decode workers, every 50 ms from the kill on
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            registered.append(requests.get(base + "/health", timeout=5).json()["decode_workers"])
            time.sleep(0.05)

    async def streams():
        results = [StreamResult() for _ in batch]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            tasks = [asyncio.create_task(stream_completion(session, base, p, TOKENS, out=r))
                     for p, r in zip(batch, results, strict=True)]
            while not all(r.chunks >= 4 for r in results):
                await asyncio.sleep(0.005)
            # a worker still streaming by its own count (a client that reads late can see a
            # stream unfinished that the worker already ended, so r.done alone is not enough)
            healths = {w: s.workers()[w].health() for w in sorted({r.decode_worker for r in results if not r.done})}
            victim = next((w for w, h in healths.items() if h.get("streams")), None)
            assert victim is not None, f"every stream had already ended on its worker: {healths}"
            engine = healths[victim]["engine"]["pid"]
            (rank1,) = children(engine)  # the engine process is rank 0; its one child is rank 1
            os.kill(rank1, signal.SIGKILL)
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            await asyncio.gather(*tasks)
            await asyncio.sleep(0.5)
            watching.set()
            watcher.join()
        return results, victim, engine

    results, victim, engine = asyncio.run(streams())
    assert_identical(results, reference(batch, TOKENS), TOKENS)
    assert metric(base, "splitserve_request_migrations_total") > migrations
    assert f"engine {victim} died" in s.log() and "a rank process is gone" in s.log(), s.log()[-3000:]
    # out of the registry, then back: a new engine process with its own rank 1
    assert any(victim not in workers for workers in registered), registered[-5:]
    healths = s.wait_recovered(timeout=120)
    new_engine = healths[victim]["engine"]["pid"]
    assert new_engine != engine and len(children(new_engine)) == 1
    deadline = time.monotonic() + 20
    while Path(f"/proc/{engine}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{engine}").exists() or Path(f"/proc/{engine}/stat").read_text().split()[2] == "Z"


def decode_workers(s: Serve) -> list[str]:
    return s.router_health()["decode_workers"]


def through_decode_workers(base: str, batch: list[list[int]]) -> list[tuple[int, str | None]]:
    """(status, decode worker) of a short greedy completion of each prompt."""
    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            return await asyncio.gather(*(complete(session, base, p, 8) for p in batch))

    return [(status, served_by(headers).get("decode")) for status, _, headers in asyncio.run(go())]


def test_a_frozen_rank_takes_its_worker_out_until_it_thaws_and_its_streams_migrate(tp_serve, reference):
    s = tp_serve
    base = s.base_url
    s.wait_recovered(timeout=120)
    batch = prompts(3206, 3, 24) + prompts(3207, 3, LONG_TOKENS)
    tokens = 4 * TOKENS  # open for 3 s or more (8 ms a step): the freeze lands mid-stream
    migrations = metric(base, "splitserve_request_migrations_total")
    stopped: list[int] = []
    seen: dict = {}

    async def go():
        results = [StreamResult() for _ in batch]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            tasks = [asyncio.create_task(stream_completion(session, base, p, tokens, out=r))
                     for p, r in zip(batch, results, strict=True)]
            while not all(r.chunks >= 4 for r in results):
                await asyncio.sleep(0.005)
            healths = {w: s.workers()[w].health() for w in sorted({r.decode_worker for r in results if not r.done})}
            victim = next((w for w, h in healths.items() if h.get("streams")), None)
            assert victim is not None, f"every stream had already ended on its worker: {healths}"
            engine = healths[victim]["engine"]["pid"]
            (rank1,) = children(engine)
            os.kill(rank1, signal.SIGSTOP)
            stopped.append(rank1)
            frozen = time.monotonic()
            while victim in await asyncio.to_thread(decode_workers, s):
                assert time.monotonic() - frozen < 60, f"{victim} stayed registered with a frozen rank"
                await asyncio.sleep(0.05)
            seen.update(victim=victim, engine=engine, rank1=rank1, left_s=time.monotonic() - frozen,
                        health=await asyncio.to_thread(s.workers()[victim].health))
            results = await asyncio.gather(*tasks)
            seen["streams_s"] = time.monotonic() - frozen
            # still frozen: new requests go to the other decode worker, none hangs
            seen["routed"] = await asyncio.to_thread(through_decode_workers, base, prompts(3208, 6, 24))
            seen["still_frozen"] = Path(f"/proc/{rank1}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        return results

    try:
        results = asyncio.run(go())
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    victim = seen["victim"]
    # the heartbeat timeout plus a ping, a watchdog tick and the bus; not the 120 s stall timeout
    assert seen["left_s"] < HEARTBEAT_S + 10, seen["left_s"]
    assert seen["health"]["status"] == "engine_unhealthy", seen["health"]
    assert f"tensor-parallel rank 1 (pid {seen['rank1']}) has not answered a heartbeat" in seen["health"]["detail"]
    assert_identical(results, reference(batch, tokens), tokens)
    assert metric(base, "splitserve_request_migrations_total") > migrations  # its streams moved
    other = next(w for w in ("decode-0", "decode-1") if w != victim)
    assert seen["still_frozen"] and seen["routed"] == [(200, other)] * 6, seen["routed"]
    # thawed: the same engine and rank (waited for, not restarted) register again, every block free
    deadline = time.monotonic() + 60
    while victim not in decode_workers(s):
        assert time.monotonic() < deadline, f"{victim} did not register again after SIGCONT"
        time.sleep(0.1)
    healths = s.wait_recovered(timeout=60)
    assert healths[victim]["engine"]["pid"] == seen["engine"] and children(seen["engine"]) == [seen["rank1"]]
    after = through_decode_workers(base, prompts(3209, 6, 24))  # and it serves again: nothing hangs
    assert all(status == 200 for status, _ in after), after
    print(f"after the thaw: {sum(w == victim for _, w in after)} of 6 new requests served by {victim}")
    print(f"frozen rank: {victim} out of the registry {seen['left_s']:.1f} s after SIGSTOP (heartbeat timeout "
          f"{HEARTBEAT_S:g} s); its streams done token-exact {seen['streams_s']:.1f} s after it")


def test_a_moe_model_over_tp2_workers_answers_as_one_process(make_ckpt, tmp_path_factory):
    model = make_ckpt("qwen3_moe")
    batch = prompts(3205, 2, LONG_TOKENS)
    hit = batch[0][:128] + prompts(3203, 1, LONG_TOKENS // 2)[0]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    with LLM(str(model), num_kv_blocks=128) as llm:
        tok = Tokenizer(str(model))
        want = [tok.decode(o.token_ids) for o in llm.generate([*batch, hit], params)]
    s = Serve(model, tmp_path_factory.mktemp("tp-moe"), extra_args=["-tp", "2", "--decode-workers", "1"])
    try:
        check_pushed_and_cached(s.base_url, batch, want)
    finally:
        s.stop()
    assert s.proc.proc.returncode == 0, s.log()[-3000:]
