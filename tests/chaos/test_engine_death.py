"""A worker whose engine fails, in a real `splitserve serve` (faults injected through
SPLITSERVE_FAULT_INJECTION, engine/faults.py): decode-0's engine thread dies mid-stream,
prefill-0 has one failing step. Before, a dead engine left a zombie: heartbeating, /health
"ok", every request sent to it hanging forever.

Now the dead worker leaves the registry at once (well within its heartbeat TTL), its
streams migrate and finish token-exact, `serve`'s /health says "degraded" until Ray has
restarted the actor, and the failed prefill step costs a local prefill, nothing else."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import pytest
import requests

from tests.chaos.conftest import LONG_TOKENS, TTL, Serve
from tests.reliability.conftest import (
    assert_identical,
    metric,
    prompts,
    stream_completion,
    wait_for,
)

DIE_AT_STEP = 30
TOKENS = 96


@pytest.fixture(scope="module")
def faulty_serve(make_ckpt, tmp_path_factory):
    once = tmp_path_factory.mktemp("faults")
    plan = [{"engine": "decode-0", "fault": "die", "at_step": DIE_AT_STEP, "once_file": str(once / "decode-0")},
            {"engine": "prefill-0", "fault": "raise", "at_step": 1, "once_file": str(once / "prefill-0")}]
    s = Serve(make_ckpt("llama"), once, env={"SPLITSERVE_FAULT_INJECTION": json.dumps(plan)})
    yield s
    s.stop()


class RouterWatch(threading.Thread):
    """Samples the router's /health every 50 ms: (time, status, decode workers)."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.url, self.samples, self.stop = base_url + "/health", [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            body = requests.get(self.url, timeout=5).json()
            self.samples.append((time.time(), body["status"], tuple(body["decode_workers"])))
            time.sleep(0.05)


def death_time(log: str) -> float:
    m = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) CRITICAL \S+: engine decode-0 died", log)
    assert m, "no log line for the engine's death"
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_dead_decode_engine_leaves_migrates_and_is_replaced(faulty_serve, reference):
    s = faulty_serve
    base = s.base_url
    batch = prompts(501, 4, 24) + prompts(502, 4, LONG_TOKENS)
    migrations_before = metric(base, "splitserve_request_migrations_total")
    watch = RouterWatch(base)
    watch.start()

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            return await asyncio.gather(*(stream_completion(session, base, p, TOKENS) for p in batch))

    results = asyncio.run(go())
    assert_identical(results, reference(batch, TOKENS), TOKENS)
    assert metric(base, "splitserve_request_migrations_total") > migrations_before

    # decode-0 leaves the registry; Ray restarts the actor, it registers again, serve is whole.
    wait_for(lambda: any("decode-0" not in decode for _, _, decode in watch.samples), 30, "decode-0 to leave")
    wait_for(lambda: watch.samples[-1][1] == "ok", 120, "decode-0 restarted and registered")
    watch.stop.set()
    watch.join()
    died = death_time(s.log())
    gone = [t for t, _, decode in watch.samples if t > died and "decode-0" not in decode]
    assert gone, "decode-0 never left the router's registry"
    assert gone[0] - died < TTL, f"decode-0 left the registry {gone[0] - died:.1f}s after its engine died"
    statuses = [status for t, status, decode in watch.samples if t > died and decode == ("decode-1",)]
    assert statuses and set(statuses) == {"degraded"}, statuses
    print(f"engine death: decode-0 out of the registry {gone[0] - died:.2f}s after dying; "
          f"serve degraded for {len(statuses) * 0.05:.1f}s until Ray restarted it")

    healths = s.wait_recovered(timeout=60)
    assert healths["prefill-0"]["engine"]["step_failures"] == 1  # the injected one; the loop went on
    assert healths["prefill-0"]["engine"]["alive"] and healths["decode-0"]["engine"]["steps"] < DIE_AT_STEP
    again = asyncio.run(go())  # the restarted worker serves (its fault fired once, before the restart)
    assert_identical(again, reference(batch, TOKENS), TOKENS)


def session_members(sid: int) -> list[str]:
    """Processes still in session `sid` (the serve process and everything Ray started for it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3] is the session id; Z: zombie
            found.append(f"{stat.parent.name} {(stat.parent / 'comm').read_text().strip()}")
    return found


def test_sigterm_to_serve_alone_stops_every_process_it_started(faulty_serve):
    """What a supervisor does (docker stop, systemd's main-PID kill): SIGTERM to the serve
    process only. Ray's agents used to outlive it by a minute or two."""
    proc = faulty_serve.proc.proc
    assert len(session_members(proc.pid)) > 5  # serve, GCS, raylet, agents, the worker actors
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, faulty_serve.log()[-3000:]
    deadline = time.monotonic() + 15
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_members(proc.pid), session_members(proc.pid)
