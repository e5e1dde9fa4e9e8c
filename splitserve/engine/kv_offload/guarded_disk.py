"""The disk tier as the offloader uses it: best-effort by construction.

No disk-tier I/O error, hang or hostile file ever reaches a request or the engine step: each
read, write and removal runs on the disk thread with a timeout (disk_guard.DiskIO), ends in
a miss or a dropped block at worst (the prefix is recomputed), is counted by kind for the
metrics, and is logged once per kind per minute (core/fault_log.py). A tier that keeps
failing is switched off (disk_guard.TierSwitch; the `splitserve_kv_offload_tier_up` metric
and the SplitserveKVDiskTierOff alert), its blocks stop being offered, and writes probe it
now and then until one succeeds.
"""

from __future__ import annotations

import logging
import threading

from splitserve.core.fault_log import FaultLog
from splitserve.engine.kv_offload.disk_guard import DiskIO, DiskTimeout, TierSwitch
from splitserve.engine.kv_offload.disk_tier import DiskTier

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 0.5  # on the engine thread: a block read takes milliseconds; past this the disk is stuck
WRITE_TIMEOUT_S = 5.0  # on the offload writer, off the step's path
FAILURE_KINDS = ("read", "write", "remove", "timeout", "off")


class GuardedDisk:
    def __init__(self, tier: DiskTier, read_timeout_s: float = READ_TIMEOUT_S,
                 write_timeout_s: float = WRITE_TIMEOUT_S, switch: TierSwitch | None = None,
                 faults: FaultLog | None = None):
        self.tier = tier
        self.read_timeout_s, self.write_timeout_s = read_timeout_s, write_timeout_s
        self.io = DiskIO()
        self.switch = switch or TierSwitch()
        self.faults = faults or FaultLog(log)
        self.failures = dict.fromkeys(FAILURE_KINDS, 0)  # read/write/remove: an error; timeout; off: skipped
        self._lock = threading.Lock()  # the switch and the counters
        if tier.start_problem:  # off from the start; writes probe until the directory can be made
            self._failed("write", tier.start_problem, stalled=True)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.tier

    def __len__(self) -> int:
        return len(self.tier)

    @property
    def usable(self) -> bool:
        """Offer the tier's blocks to lookups: on, and no operation hung."""
        return self.switch.on and not self.io.stuck

    def files(self):
        return self.tier.files()

    def read(self, block_hash: int) -> bytes | None:
        """The block's bytes, or None: a miss (counted and logged; the caller recomputes)."""
        try:
            payload, problem = self.io.call(lambda: self.tier.read(block_hash), self.read_timeout_s)
        except DiskTimeout as exc:
            self._failed("timeout", f"reading block {block_hash:016x} from {self.tier.parent}: {exc}", stalled=True)
            return None
        self._count_removals()
        if problem:
            self._failed("read", problem)
            return None
        self._succeeded()
        return payload

    def write(self, block_hash: int, payload: memoryview) -> tuple[bool, list[int]]:
        """(written, hashes evicted to make room). Skipped while the tier is off (between probes)."""
        with self._lock:
            allowed = self.switch.allow() and not self.io.stuck
            if not allowed:
                self.failures["off"] += 1
        if not allowed:
            return False, []
        try:
            written, evicted, problem = self.io.call(lambda: self.tier.write(block_hash, payload),
                                                     self.write_timeout_s)
        except DiskTimeout as exc:
            self._failed("timeout", f"writing block {block_hash:016x} to {self.tier.parent}: {exc}", stalled=True)
            return False, []
        self._count_removals()
        if written:
            self._succeeded()
        else:
            self._failed("write", f"{problem}; the block is dropped")
        return written, evicted

    def clear(self) -> list[int]:
        """Forget every block now; their files are removed on the disk thread."""
        hashes = self.tier.clear()
        if hashes:
            self.io.post(lambda: (self.tier.unlink_files(hashes), self._count_removals()))
        return hashes

    def check_directory(self) -> None:
        """Notice a deleted directory while idle (made again, its blocks reported lost), not only
        at the next write: blocks still on the device are then written down again."""
        if self.switch.on and not self.io.stuck:
            self.io.post(self._check_directory)

    def _check_directory(self) -> None:
        problem = self.tier.ensure_directory()
        if problem:
            self._failed("write", problem)

    def flush(self, timeout: float) -> bool:
        """True once everything posted to the disk thread so far has run."""
        try:
            self.io.call(lambda: None, timeout)
        except DiskTimeout:
            return False
        return True

    def take_lost(self) -> list[int]:
        return self.tier.take_lost()

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)

    def close(self) -> None:
        """Remove the tier's files and directory (a graceful stop leaves nothing behind)."""
        if not self.io.close(self.write_timeout_s):
            log.warning("KV offload: the disk tier under %s did not answer at close; its directory %s is left for "
                        "the next worker to remove", self.tier.parent, self.tier.dir)
            return
        self.tier.close()

    # ---- bookkeeping ---------------------------------------------------------------------
    def _count_removals(self) -> None:
        """Files that could not be removed (immutable, a read-only mount): counted, logged, and
        tried again by the tier at each write, since they still take space."""
        n, last = self.tier.take_remove_failures()
        if n:
            with self._lock:
                self.failures["remove"] += n
            self.faults.report("remove", "KV offload: disk tier remove failed for %d files, kept for now: %s", n, last)

    def _succeeded(self) -> None:
        with self._lock:
            back = self.switch.succeeded()
        if back:
            log.warning("KV offload: the disk tier under %s works again and is back in use", self.tier.parent)

    def _failed(self, kind: str, problem: str, stalled: bool = False) -> None:
        with self._lock:
            self.failures[kind] += 1
            tripped = self.switch.failed(stalled)
        self.faults.report(kind, "KV offload: disk tier %s failed, recomputing instead: %s", kind, problem)
        if tripped:
            log.warning("KV offload: the disk tier under %s is switched off after %d failures in a row (last: %s); "
                        "its blocks are recomputed and it is retried every few seconds. Check the directory's "
                        "permissions, free space and mount", self.tier.parent, self.switch.failures_in_row, problem)
