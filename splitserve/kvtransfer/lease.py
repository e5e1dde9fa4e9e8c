"""Receiver-side leases: the destination blocks reserved for each in-flight transfer.

The decode worker allocates the blocks and hands them over with expect(); from then
until the outcome, the lease table decides when they are given back. Invariants:
  * every lease ends exactly once (ok, or failed with a reason) and its future resolves;
  * a failed lease's blocks are released exactly once, and only when nothing can still
    write into them: no receiver thread mid-copy, no one-sided writer stream open
    (or that stream ended `quarantine_s` ago, or it overstayed a whole timeout);
  * a successful lease's blocks are never released here: they belong to the request.
Release callbacks and future results run outside the table's lock.
(Over 300 lines on purpose: these invariants hold only if every transition of a lease is
in one place, under one lock; splitting the table would split the proof.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from splitserve.kvtransfer import outcome as R
from splitserve.kvtransfer.outcome import TransferOutcome
from splitserve.kvtransfer.wire import TransferHeader

log = logging.getLogger(__name__)
_TOMBSTONES = 4096  # ended request ids remembered, to answer late pushes precisely


class LeaseError(Exception):
    """A push that cannot proceed; `status` is a PushStatus name for the ack."""

    def __init__(self, status: str, detail: str, retry_allowed: bool = False):
        super().__init__(detail)
        self.status, self.detail, self.retry_allowed = status, detail, retry_allowed


@dataclass
class Lease:
    request_id: str
    dest_block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    release_blocks: Callable[[list[int]], None]
    future: Future
    created: float
    deadline: float
    timeout_s: float
    layers_done: list[bool]
    layers_claimed: list[bool]
    backend: str = ""
    failed_attempts: int = 0
    io: int = 0  # receiver threads touching the blocks right now
    one_sided_streams: int = 0
    one_sided_used: bool = False
    one_sided_ended_at: float = 0.0
    bytes_received: int = 0
    outcome: TransferOutcome | None = None
    failed_at: float = 0.0
    released: bool = False
    pending_actions: list = field(default_factory=list)


_STATUS_FOR_REASON = {
    R.ABORTED: "REQUEST_ABORTED", R.TIMEOUT: "LEASE_EXPIRED", R.RECEIVER_STOPPED: "RECEIVER_STOPPING",
}


class LeaseTable:
    def __init__(self, max_attempts: int, quarantine_s: float, clock: Callable[[], float] = time.monotonic,
                 on_outcome: Callable[[Lease, TransferOutcome], None] | None = None):
        self.max_attempts = max_attempts
        self.quarantine_s = quarantine_s
        self.clock = clock
        self.on_outcome = on_outcome
        self._lock = threading.Lock()
        self._active: dict[str, Lease] = {}
        self._ending: list[Lease] = []  # failed, blocks not yet released
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> final reason

    # ---- owner side -----------------------------------------------------------
    def expect(self, request_id: str, dest_block_ids: Sequence[int], block_hashes: Sequence[int],
               num_layers: int, timeout_s: float, release_blocks: Callable[[list[int]], None]) -> Future:
        dest = tuple(int(b) for b in dest_block_ids)
        if not dest:
            raise ValueError(f"request {request_id!r}: expect() needs at least one destination block")
        if len(set(dest)) != len(dest):
            raise ValueError(f"request {request_id!r}: destination blocks repeat: {list(dest)}")
        if len(block_hashes) > len(dest):
            raise ValueError(f"request {request_id!r}: {len(block_hashes)} block hashes for {len(dest)} blocks")
        if timeout_s <= 0:
            raise ValueError(f"request {request_id!r}: timeout must be positive, got {timeout_s}")
        now = self.clock()
        with self._lock:
            if request_id in self._active:
                raise ValueError(f"request {request_id!r} already has a KV transfer in flight on this receiver")
            self._ended.pop(request_id, None)
            lease = Lease(request_id, dest, tuple(int(h) for h in block_hashes), release_blocks, Future(),
                          now, now + timeout_s, timeout_s, [False] * num_layers, [False] * num_layers)
            self._active[request_id] = lease
        return lease.future

    def abort(self, request_id: str, detail: str) -> bool:
        """End a request's lease (the request was cancelled). False if none is open."""
        return self.fail_request(request_id, R.ABORTED, detail)

    def fail_request(self, request_id: str, reason: str, detail: str) -> bool:
        with self._lock:
            lease = self._active.get(request_id)
            if lease is not None:
                self._fail(lease, reason, detail)
        self._flush(lease)
        return lease is not None

    # ---- stream side ------------------------------------------------------------
    def attach(self, header: TransferHeader, one_sided: bool) -> Lease:
        rid = header.request_id
        with self._lock:
            lease = self._active.get(rid)
            if lease is None:
                reason = self._ended.get(rid)
                if reason is None:
                    raise LeaseError("UNKNOWN_REQUEST", f"no KV transfer expected for request {rid!r} "
                                     "(the decode worker must call expect() before the prefill pushes)")
                status = _STATUS_FOR_REASON.get(reason, "UNKNOWN_REQUEST")
                raise LeaseError(status, f"request {rid!r} already ended on this receiver ({reason})")
            problem = self._header_mismatch(lease, header)
            if problem is not None:
                self._fail(lease, R.BAD_HEADER, problem)
            else:
                layers = range(header.layer_start, header.layer_end)
                if any(lease.layers_done[i] or lease.layers_claimed[i] for i in layers):
                    problem = f"layers [{header.layer_start}, {header.layer_end}) of request {rid!r} are already received or in flight"
                else:
                    for i in layers:
                        lease.layers_claimed[i] = True
                    lease.backend = header.backend
                    if one_sided:
                        lease.one_sided_streams += 1
                        lease.one_sided_used = True
                    return lease
        self._flush(lease)
        raise LeaseError("BAD_HEADER", problem)

    def begin_io(self, lease: Lease) -> None:
        with self._lock:
            if lease.outcome is not None:
                raise LeaseError(_STATUS_FOR_REASON.get(lease.outcome.reason, "UNKNOWN_REQUEST"),
                                 f"request {lease.request_id!r} ended ({lease.outcome.reason}): {lease.outcome.detail}")
            lease.io += 1

    def end_io(self, lease: Lease, nbytes: int = 0) -> None:
        with self._lock:
            lease.io -= 1
            lease.bytes_received += nbytes
            self._maybe_release(lease, self.clock())
        self._flush(lease)

    def push_succeeded(self, lease: Lease, header: TransferHeader) -> bool:
        """Mark the push's layers received; the lease ends ok once all layers are in.
        False if the lease had already ended (the push arrived too late)."""
        with self._lock:
            if lease.outcome is not None:
                return False
            for i in range(header.layer_start, header.layer_end):
                lease.layers_done[i] = True
            if all(lease.layers_done):
                self._end(lease, TransferOutcome(lease.request_id, True, R.OK, "",
                                                 lease.bytes_received, self.clock() - lease.created))
        self._flush(lease)
        return True

    def checksum_failed(self, lease: Lease, detail: str) -> bool:
        """Count a corrupted push; True if the sender may push again."""
        with self._lock:
            lease.failed_attempts += 1
            if lease.outcome is None and lease.failed_attempts >= self.max_attempts:
                self._fail(lease, R.CHECKSUM_MISMATCH,
                           f"{detail}; gave up after {lease.failed_attempts} corrupted pushes")
            retry = lease.outcome is None
        self._flush(lease)
        return retry

    def fail(self, lease: Lease, reason: str, detail: str) -> None:
        with self._lock:
            self._fail(lease, reason, detail)
        self._flush(lease)

    def detach(self, lease: Lease, header: TransferHeader, one_sided: bool, lost: str | None) -> None:
        """A stream ended. `lost`: why it ended before completing its push (None if it completed
        or was answered); the lease then fails, since a broken sender will not come back."""
        with self._lock:
            for i in range(header.layer_start, header.layer_end):
                lease.layers_claimed[i] = False
            if one_sided:
                lease.one_sided_streams -= 1
                lease.one_sided_ended_at = self.clock()
            if lost is not None:
                self._fail(lease, R.SENDER_LOST, lost)
            self._maybe_release(lease, self.clock())
        self._flush(lease)

    # ---- timekeeping ------------------------------------------------------------
    def tick(self) -> float:
        """Expire overdue leases, release quarantined blocks; returns seconds until the next due time."""
        now = self.clock()
        touched = []
        with self._lock:
            for lease in [x for x in self._active.values() if now >= x.deadline]:
                self._fail(lease, R.TIMEOUT, f"no complete, verified transfer within {lease.timeout_s:g}s")
                touched.append(lease)
            for lease in list(self._ending):
                self._maybe_release(lease, now)
                touched.append(lease)
            due = [x.deadline for x in self._active.values()]
            due += [self._release_due(x) for x in self._ending]
        for lease in touched:
            self._flush(lease)
        return max(0.0, min(due) - now) if due else 3600.0

    def stop(self, detail: str) -> None:
        """Receiver shutting down: end every lease and release every block now."""
        with self._lock:
            leases = list(self._active.values()) + list(self._ending)
            for lease in leases:
                self._fail(lease, R.RECEIVER_STOPPED, detail)
                self._release(lease)
        for lease in leases:
            self._flush(lease)

    def snapshot(self) -> dict[str, dict]:
        with self._lock:
            return {rid: {"blocks": len(x.dest_block_ids), "bytes_received": x.bytes_received,
                          "layers_done": sum(x.layers_done), "failed_attempts": x.failed_attempts,
                          "one_sided_writers": x.one_sided_streams,
                          "seconds_left": round(x.deadline - self.clock(), 3)}
                    for rid, x in self._active.items()}

    @property
    def reserved_blocks(self) -> int:
        with self._lock:
            return sum(len(x.dest_block_ids) for x in list(self._active.values()) + self._ending)

    # ---- internals (lock held) ------------------------------------------------------
    @staticmethod
    def _header_mismatch(lease: Lease, header: TransferHeader) -> str | None:
        rid = lease.request_id
        if tuple(header.dest_block_ids) != lease.dest_block_ids:
            return (f"request {rid!r}: pushed to blocks {header.dest_block_ids[:8]}... but the lease holds "
                    f"{list(lease.dest_block_ids[:8])}...")
        if tuple(header.block_hashes) != lease.block_hashes:
            return (f"request {rid!r}: block hashes differ from the ones the decode worker expects "
                    "(prefill computed a different prompt, or a different model / cache salt)")
        if header.layer_end > len(lease.layers_done):
            return f"request {rid!r}: layer range ends at {header.layer_end}, pool has {len(lease.layers_done)} layers"
        return None

    def _end(self, lease: Lease, result: TransferOutcome) -> None:
        lease.outcome = result
        self._active.pop(lease.request_id, None)
        self._ended[lease.request_id] = result.reason
        while len(self._ended) > _TOMBSTONES:
            self._ended.popitem(last=False)
        lease.pending_actions.append(("resolve", result))

    def _fail(self, lease: Lease, reason: str, detail: str) -> None:
        if lease.outcome is not None:
            return
        now = self.clock()
        lease.failed_at = now
        self._end(lease, TransferOutcome(lease.request_id, False, reason, detail,
                                         lease.bytes_received, now - lease.created))
        self._ending.append(lease)
        self._maybe_release(lease, now)

    def _release_due(self, lease: Lease) -> float:
        """When a failed lease's blocks should next be looked at (lock held)."""
        if lease.one_sided_streams:
            return lease.failed_at + lease.timeout_s  # a writer that overstays is cut off
        if lease.one_sided_used:
            return lease.one_sided_ended_at + self.quarantine_s
        return self.clock() + 0.5  # a copy in progress: end_io releases, this is a backstop

    def _maybe_release(self, lease: Lease, now: float) -> None:
        if lease.released or lease.outcome is None or lease.outcome.ok or lease.io:
            return
        if lease.one_sided_streams:
            if now < lease.failed_at + lease.timeout_s:
                return
            log.warning("request %r: releasing %d KV blocks while a one-sided writer stream is still open "
                        "%.1fs after the transfer failed; a late write from that prefill worker could "
                        "corrupt them", lease.request_id, len(lease.dest_block_ids), now - lease.failed_at)
        elif lease.one_sided_used and now < lease.one_sided_ended_at + self.quarantine_s:
            return
        self._release(lease)

    def _release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        if lease in self._ending:
            self._ending.remove(lease)
        lease.pending_actions.append(("release", list(lease.dest_block_ids)))

    def _flush(self, lease: Lease | None) -> None:
        """Run a lease's queued callbacks outside the lock: blocks go back before the
        future resolves, so an owner reacting to the outcome sees them free."""
        if lease is None:
            return
        with self._lock:
            actions, lease.pending_actions = lease.pending_actions, []
        actions.sort(key=lambda a: a[0] != "release")
        for kind, payload in actions:
            if kind == "release":
                try:
                    lease.release_blocks(payload)
                except Exception:
                    log.exception("request %r: the owner's release_blocks callback failed for blocks %s; "
                                  "those KV blocks may be leaked", lease.request_id, payload)
            else:
                if self.on_outcome is not None:
                    self.on_outcome(lease, payload)
                lease.future.set_result(payload)
