"""The disk KV tier under hostile conditions (issue 48), below the engine: files swapped for a
FIFO, a symlink to /dev/zero or another tier's file, immutable files, the directory deleted,
a full filesystem, a disk that hangs. Each ends in a miss or a dropped block, never an
exception, a block or an unbounded read; the tier recovers by itself; one log line per fault
per minute. The engine-level runs (exact tokens) are in test_kv_offload_tiers.py and the
`serve` runs in tests/chaos/test_disk_tier_serve.py."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from splitserve.core.fault_log import FaultLog
from splitserve.engine.kv_offload.block_file import HEADER
from splitserve.engine.kv_offload.disk_guard import DiskIO, DiskTimeout, TierSwitch
from splitserve.engine.kv_offload.disk_tier import DiskTier
from splitserve.engine.kv_offload.guarded_disk import GuardedDisk
from tests.helpers.tmpfs import tmpfs

NB = 4096  # a block's bytes here


def payload(i: int) -> memoryview:
    return memoryview(bytes([i % 251]) * NB)


def tier(directory: Path, blocks: int = 64, **kw) -> DiskTier:
    return DiskTier(directory, blocks * (HEADER.size + NB), NB, layout_tag=7, **kw)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def immutable(*paths: Path):
    """chattr +i: even root cannot unlink or rewrite the files (as on the red-team's tier)."""
    subprocess.run(["chattr", "+i", *map(str, paths)], check=True)
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=True)


# ---- the pure parts ------------------------------------------------------------------------
def test_fault_log_writes_one_line_per_fault_per_interval(caplog):
    clock = Clock()
    faults = FaultLog(logging.getLogger("t.faults"), interval_s=60, clock=clock)
    with caplog.at_level(logging.WARNING, "t.faults"):
        logged = [faults.report("read", "read failed %d", i) for i in range(700)]
        faults.report("write", "write failed")
        clock.now += 61
        faults.report("read", "read failed again")
    assert logged.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "read failed 0", "write failed", "read failed again (699 more like this in the last 60s not logged)"]


def test_tier_switch_trips_after_failures_in_a_row_probes_with_backoff_and_comes_back():
    clock = Clock()
    switch = TierSwitch(trip_after=3, retry_s=5, max_retry_s=12, clock=clock)
    assert not switch.failed() and not switch.failed()
    switch.succeeded()  # a success resets the run
    assert [switch.failed() for _ in range(3)] == [False, False, True]
    assert not switch.on and not switch.allow()
    clock.now += 5
    assert switch.allow() and not switch.allow()  # one probe per interval
    switch.failed()  # the probe failed: the next one in 10 s
    clock.now += 9
    assert not switch.allow()
    clock.now += 1
    assert switch.allow()
    switch.failed()
    clock.now += 11
    assert not switch.allow()  # capped at 12 s
    clock.now += 1
    assert switch.allow() and switch.succeeded() and switch.on and switch.times_off == 1
    assert switch.failed(stalled=True) and not switch.on  # a hang trips it at once


def test_disk_io_gives_up_on_a_hung_operation_and_skips_the_disk_until_it_returns():
    io, release = DiskIO(), threading.Event()
    try:
        start = time.monotonic()
        with pytest.raises(DiskTimeout):
            io.call(release.wait, timeout=0.2)
        assert time.monotonic() - start < 2 and io.stuck
        start = time.monotonic()
        with pytest.raises(DiskTimeout):
            io.call(lambda: 1, timeout=5)  # refused at once: nothing queues behind a hang
        assert time.monotonic() - start < 0.5
        release.set()
        deadline = time.monotonic() + 5
        while io.stuck:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert io.call(lambda: 41 + 1, timeout=5) == 42
        with pytest.raises(ZeroDivisionError):  # an error reaches the caller, the thread lives on
            io.call(lambda: 1 / 0, timeout=5)
        assert io.call(lambda: "alive", timeout=5) == "alive"
    finally:
        release.set()
        assert io.close()


# ---- one tier, its files attacked ----------------------------------------------------------
def written(t: DiskTier, *hashes: int) -> None:
    for h in hashes:
        ok, _, problem = t.write(h, payload(h))
        assert ok, problem


@pytest.mark.parametrize("swap", ["fifo", "symlink_dev_zero", "symlink_passwd", "directory", "oversized"])
def test_a_swapped_block_file_is_a_quick_bounded_miss(tmp_path, swap):
    t = tier(tmp_path)
    written(t, 1, 2)
    path = t.path(1)
    path.unlink()
    if swap == "fifo":
        os.mkfifo(path)  # an open() without O_NONBLOCK would wait for a writer forever
    elif swap == "symlink_dev_zero":
        path.symlink_to("/dev/zero")  # read without bound: MemoryError
    elif swap == "symlink_passwd":
        path.symlink_to("/etc/passwd")
    elif swap == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\0" * (1 << 26))  # 64 MiB: never read
    start = time.monotonic()
    data, problem = t.read(1)
    assert data is None and problem and time.monotonic() - start < 1.0
    assert 1 not in t and t.read(2)[0] == bytes(payload(2))  # the rest of the tier is untouched
    t.close()


def test_a_block_file_from_another_tier_is_a_miss_even_when_intact(tmp_path):
    """Another model's (or deployment's) file for the same block hash and the same pool
    layout passes every check but the MAC: provenance, not integrity."""
    mine, theirs = tier(tmp_path / "mine"), tier(tmp_path / "theirs")
    written(mine, 5)
    theirs.write(5, memoryview(b"\x42" * NB))
    shutil.copyfile(theirs.path(5), mine.path(5))
    data, problem = mine.read(5)
    assert data is None and "MAC" in problem
    assert not mine.path(5).exists() and 5 not in mine
    mine.close(), theirs.close()


def test_the_deleted_directory_is_made_again_and_the_tier_serves_again(tmp_path):
    t = tier(tmp_path)
    written(t, 1, 2, 3)
    first = t.dir
    shutil.rmtree(first)
    data, problem = t.read(2)
    assert data is None and problem
    assert sorted(t.take_lost()) == [1, 3] and len(t) == 0  # gone with it: removed events for them
    assert t.dir is not None and t.dir.is_dir() and t.dir != first
    written(t, 4)
    assert t.read(4)[0] == bytes(payload(4))
    t.close()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_cannot_be_made_leaves_the_tier_without_one_not_the_worker_dead(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    t = tier(tmp_path / "file" / "kv")
    assert t.dir is None and "Not a directory" in t.start_problem
    ok, _, problem = t.write(1, payload(1))
    assert not ok and "Not a directory" in problem
    (tmp_path / "file").unlink()
    written(t, 1)  # the next write made it: the tier works from then on
    assert t.read(1)[0] == bytes(payload(1))
    t.close()


def test_immutable_files_are_contained(tmp_path):
    t = tier(tmp_path, blocks=2)
    written(t, 1, 2)
    with immutable(t.path(1), t.path(2)):
        ok, evicted, _ = t.write(3, payload(3))  # evicting 1 cannot remove its file: still written
        assert ok and evicted == [1]
        t.unlink_files(t.clear())
        n, last = t.take_remove_failures()
        assert n == 2 and "Operation not permitted" in last  # 1 at the eviction, 2 at the clear (3 went)
        written(t, 4)
        assert t.path(1).exists() and t.path(2).exists()  # still there, and still taking space
    written(t, 5)  # the next write, once they can go, removes them
    assert not t.path(1).exists() and not t.path(2).exists() and not t.path(3).exists()
    t.close()
    assert list(tmp_path.iterdir()) == []


def test_a_full_filesystem_rotates_the_tiers_own_blocks_and_grows_back_when_space_is_freed(tmp_path):
    with tmpfs(tmp_path / "fs", "1m") as fs:
        t = tier(fs, blocks=1000, reserve_bytes=0)  # the flag allows far more than the disk holds
        for h in range(1, 400):
            t.write(h, payload(h))
        held = len(t)
        assert 100 < held < 260 and t.effective_capacity == held
        newest = list(range(400 - held, 400))
        assert all(h in t for h in newest)  # the least recently used made room for the newest
        assert t.read(399)[0] == bytes(payload(399))
        hog = fs / "hog"
        with open(hog, "wb") as f:  # someone else fills the disk
            while True:
                try:
                    f.write(b"\0" * 65536)
                    f.flush()
                except OSError:
                    break
        for h in range(400, 420):  # still written: the tier's own oldest blocks make room
            ok, evicted, problem = t.write(h, payload(h))
            assert ok and evicted, problem
        hog.unlink()
        for h in range(420, 500):
            t.write(h, payload(h))
        assert len(t) > 20 + 60  # grew back
        t.close()


# ---- the guard: what the offloader sees ----------------------------------------------------
def test_a_hung_read_costs_one_timeout_then_the_tier_is_skipped_until_the_disk_answers(tmp_path, caplog):
    t = tier(tmp_path)
    written(t, 1)
    disk = GuardedDisk(t, read_timeout_s=0.2, write_timeout_s=0.2)
    release, real_read = threading.Event(), t.read

    def hung_read(h):
        release.wait()
        return real_read(h)

    t.read = hung_read
    with caplog.at_level(logging.WARNING):
        start = time.monotonic()
        assert disk.read(1) is None
        assert time.monotonic() - start < 1.5
        assert not disk.usable and disk.failure_counts()["timeout"] == 1
        assert disk.write(2, payload(2)) == (False, [])  # skipped, not queued behind the hang
        release.set()
        deadline = time.monotonic() + 5
        while disk.io.stuck:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert sum("disk tier timeout failed" in r.getMessage() for r in caplog.records) == 1
    disk.close()


def test_a_tier_that_keeps_failing_is_switched_off_and_back_on_when_it_recovers(tmp_path, caplog):
    clock = Clock()
    t = tier(tmp_path)
    disk = GuardedDisk(t, switch=TierSwitch(trip_after=5, retry_s=5, clock=clock),
                       faults=FaultLog(logging.getLogger("t.guard"), clock=clock))
    with caplog.at_level(logging.WARNING):
        shutil.rmtree(tmp_path)
        tmp_path.write_text("the directory is now a file: every write fails")
        for h in range(10):
            assert disk.write(h, payload(h)) == (False, [])
        assert not disk.usable
        assert disk.failure_counts() == {"read": 0, "write": 5, "remove": 0, "timeout": 0, "off": 5}
        tmp_path.unlink()  # fixed
        assert disk.write(20, payload(20)) == (False, [])  # between probes: not tried
        clock.now += 5
        assert disk.write(21, payload(21)) == (True, [])  # the probe works: back on
        assert disk.usable and disk.read(21) == bytes(payload(21))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("disk tier write failed" in m for m in messages) == 1  # five failures, one line
    assert sum("switched off" in m for m in messages) == 1 and sum("back in use" in m for m in messages) == 1
    disk.close()
