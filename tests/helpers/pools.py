"""The invariant after every test that drives a serving stack (issue 38): every worker's KV
pool back at idle, free blocks = total (evictable prefix-cache blocks count as free), no
sequence, remote prefill, KV lease, held push, waiter or stream left. Checked by autouse
fixtures in tests/e2e, tests/chaos and tests/reliability, so the next leak fails the test
that caused it rather than a later one, or none."""

from __future__ import annotations

import re
import time

import pytest
import requests

from tests.helpers.processes import SplitserveProcess

# serve's own line, printed before it serves: "splitserve: decode worker decode-0: gRPC 127.0.0.1:1,
# KV receiver 127.0.0.1:2, metrics http://127.0.0.1:3/metrics"; and the worker's log line, relayed
# by Ray (later, and again after a restart): "... decode worker decode-0 serving on 127.0.0.1:1
# (KV receiver 127.0.0.1:2, 256 blocks, admin http://127.0.0.1:3; ..."
WORKER_LINE = re.compile(
    r"(decode|prefill) worker (\S+?):? (?:gRPC|serving on) ([0-9.:]+),? (?:\(?KV receiver ([0-9.:]+), )?"
    r".*?(?:metrics|admin) (http://[0-9.:]+)")


def serve_admins(log: str) -> dict[str, str]:
    """worker id -> its latest admin URL, from a `serve` log (a restarted worker logs a new one)."""
    return {m.group(2): m.group(5) for m in WORKER_LINE.finditer(log)}


def kv_idle(kv: dict) -> bool:
    return (kv.get("free_blocks") == kv.get("total_blocks") and kv.get("sequences") == 0
            and not kv.get("remote_prefills") and not kv.get("kv_leases") and not kv.get("held_for_push")
            and not kv.get("held_blocks") and not kv.get("waiters")
            and not kv.get("held_expired"))  # a hold the prefill worker's sweep had to release: a leak


def wait_pools_idle(admins: dict[str, str], timeout: float = 30.0) -> dict[str, dict]:
    """Until every worker's pool is idle; AssertionError naming what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        states: dict[str, dict] = {}
        for worker, url in admins.items():
            try:
                body = requests.get(url + "/health", timeout=5).json()
                states[worker] = {**body.get("kv", {}), "streams": body.get("streams", 0)}
            except (requests.RequestException, ValueError) as exc:
                states[worker] = {"unreachable": repr(exc)}
        if all(kv_idle(s) and not s.get("streams") for s in states.values()):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pools not back at idle {timeout:.0f}s after the test (a leak?): {states}")
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def pools_back_to_idle():
    """Autouse in tests/e2e and tests/chaos (imported by their conftests): after each test,
    every `serve` still running has every pool at idle, and every `serve` the test stopped had
    (SplitserveProcess.stop checks before its Ctrl-C)."""
    SplitserveProcess.held_at_stop.clear()  # a module fixture's stop after its last test: checked there
    yield
    held, SplitserveProcess.held_at_stop[:] = list(SplitserveProcess.held_at_stop), []
    assert not held, held
    for serve in list(SplitserveProcess.serving):
        if serve.proc.poll() is None:
            wait_pools_idle(serve_admins(serve.log()))
