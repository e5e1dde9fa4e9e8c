"""`serve` watches the Ray processes it started (splitserve/ray_watch.py, issue 39). Before,
with the raylet killed `/health` stayed `ok` and no dead worker could ever come back; with the
GCS killed serving went on a minute, then `serve` exited with only Ray's own line and left
Ray's agents running. Now: one line naming the process, exit 1 within seconds, and not one
process of the run left (the agents a dead raylet leaves to init included)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.chaos.test_engine_death import session_members
from tests.helpers.processes import SplitserveProcess

LABELS = {"raylet": "raylet", "gcs_server": "GCS (gcs_server)", "log_monitor": "log monitor"}


def _is(pid: int, comm: str, victim: str) -> bool:
    if victim != "log_monitor":
        return comm == victim
    try:  # a Python script: known by its command line
        return b"log_monitor.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("victim", list(LABELS))
def test_a_dead_ray_process_stops_serve_with_one_line_and_leaves_nothing(make_ckpt, victim):
    serve = SplitserveProcess("serve", ["--model", str(make_ckpt("llama")), "--prefill-workers", "0",
                                        "--decode-workers", "1"])
    try:
        sid = serve.proc.pid
        members = session_members(sid)
        pid = next(int(m.split()[0]) for m in members if _is(int(m.split()[0]), m.split()[1], victim))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = serve.proc.wait(timeout=60)
        took = time.monotonic() - killed
        assert code == 1, serve.log()[-3000:]
        lines = [ln for ln in serve.log().splitlines() if "splitserve serve: Ray's" in ln]
        assert len(lines) == 1 and f"Ray's {LABELS[victim]} (pid {pid}) exited with code -9" in lines[0], lines
        assert "exits 1 for its supervisor to start it again" in lines[0]
        deadline = time.monotonic() + 15
        while session_members(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not session_members(sid), session_members(sid)
        print(f"{victim} killed: serve exited 1 after {took:.1f} s, nothing left")
    finally:
        serve.stop()
