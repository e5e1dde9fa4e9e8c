"""A thin shell around one Mooncake Transfer Engine instance.

Metadata exchange is P2PHANDSHAKE (no etcd/metadata server): an engine listens on an
RPC port and its session id is "host:port"; a peer that knows the session id and a
registered address can write there. Protocol `tcp` works anywhere (these machines);
`rdma` needs an RDMA NIC, with `device` naming it (e.g. "mlx5_0").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

log = logging.getLogger(__name__)

# Mooncake's TCP transport moves each write over one of a few connections ("lanes") per
# peer, in socket reads and writes of MC_TCP_SLICE_SIZE, all driven by one I/O thread;
# a lane takes its next write once the receiver acknowledged the last. Its defaults
# (64 KiB slices, 4 lanes) spend that thread on per-slice work; 1 MiB slices over 8
# lanes measured best on loopback, 1-2 lanes clearly worse (docs/kv_transfer.md).
# Explicit environment settings win.
TCP_TUNING = {"MC_TCP_SLICE_SIZE": str(1 << 20), "MC_TCP_LANES_PER_PEER": "8"}

# transfer_check_status results, and the batch ids transfer_submit_write returns on failure.
_PENDING, _COMPLETED, _FAILED = 0, 1, -1
_INVALID_BATCH = (0, -1, (1 << 64) - 1)


class MooncakeError(RuntimeError):
    pass


class Write(NamedTuple):
    """One one-sided write: `count` stream regions starting at region `first`."""

    src: int
    dst: int
    length: int
    first: int
    count: int


def coalesce(src: Sequence[int], dst: Sequence[int], length: int, max_bytes: int = 8 << 20) -> list[Write]:
    """One write per run of regions adjacent on both sides (fewer, larger transfers), runs
    capped at max_bytes so that a landed run is hashed and reported while later runs
    are still on the wire."""
    writes: list[Write] = []
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        last = writes[-1] if writes else None
        if (last is not None and last.src + last.length == s and last.dst + last.length == d
                and last.length + length <= max_bytes):
            writes[-1] = last._replace(length=last.length + length, count=last.count + 1)
        else:
            writes.append(Write(s, d, length, i, 1))
    return writes


class PollPacer:
    """How long the polling thread naps between status polls of in-flight writes.

    Each wake-up costs the sending host more than the poll itself: a timer, a context
    switch, and a preempted transport I/O thread where the two share a core. Napping
    20-200 µs cost bare loopback writes about a quarter of their throughput on the
    2-core dev VM (docs/kv_transfer.md). So a nap is a share of the time the bytes still
    in flight need at the rate recent writes achieved: long naps (capped) while much is
    in flight, short ones near the end, where they add to the transfer's latency."""

    SHARE = 0.25  # of the in-flight bytes' expected time: ~4 polls per write at the end
    MIN_NAP_S = 20e-6
    MAX_NAP_S = 2e-3  # bounds how late a landing is reported (verification overlap)
    MIN_SAMPLE_BYTES = 8 << 20  # smaller transfers measure latency, not rate

    def __init__(self, rate_bytes_per_s: float = 4e9):
        self.rate = rate_bytes_per_s  # optimistic start: too high only means extra polls

    def nap(self, in_flight_bytes: int) -> float:
        return min(max(self.SHARE * in_flight_bytes / self.rate, self.MIN_NAP_S), self.MAX_NAP_S)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A finished transfer of nbytes that took seconds: move the rate halfway to it."""
        if nbytes >= self.MIN_SAMPLE_BYTES and seconds > 0:
            self.rate = 0.5 * self.rate + 0.5 * nbytes / seconds


def _import_engine():
    # Mooncake logs every connection at INFO through glog; keep warnings and errors.
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeError(
            "the mooncake KV transfer backend needs the Mooncake Transfer Engine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU hosts) or mooncake-transfer-engine (CUDA), and the "
            f"system library libibverbs1 (apt-get install libibverbs1); import failed: {exc}") from exc
    return TransferEngine


def gpu_memory_problem(device_type: str) -> str | None:
    """Why this Mooncake build cannot move a KV pool on `device_type`, or None. The non-CUDA
    build's transports read and write registered memory with plain CPU instructions (tcp:
    socket send/recv straight from it): on an H200 every write from a GPU pool failed with
    EFAULT and each request fell back to a local prefill (issue 20). The CUDA build stages
    GPU memory through host buffers itself (not tried here: no CUDA build on this project's
    machines)."""
    if device_type != "cuda":
        return None
    from importlib import metadata

    def installed(name: str) -> bool:
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            return False

    if installed("mooncake-transfer-engine-non-cuda") and not installed("mooncake-transfer-engine"):
        return ("the KV pool is in GPU memory, which the installed Mooncake build (mooncake-transfer-engine-non-cuda) "
                "cannot read or write: install the CUDA build (pip install mooncake-transfer-engine) or use "
                "--kv-backend grpc")
    return None


def _transfer_timeout_s() -> float:
    try:  # Mooncake's own knob, with its floor of 5 s
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    except ValueError:
        return 30.0


class MooncakeEndpoint:
    POLL_WINDOW = 8  # pending writes whose status one poll round reads

    def __init__(self, host: str, protocol: str, device: str = ""):
        engine_cls = _import_engine()
        if protocol == "tcp":
            for key, value in TCP_TUNING.items():
                os.environ.setdefault(key, value)  # read by the engine when it starts its transport
        self.engine = engine_cls()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise MooncakeError(f"Mooncake Transfer Engine failed to start on {host} with protocol {protocol!r} "
                                f"device {device!r} (rc={rc}); for rdma check the device name with ibv_devices")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.protocol = protocol
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self.pacer = PollPacer()

    def register(self, addr: int, nbytes: int, device_type: str = "cpu") -> None:
        """Register a memory region once (the KV pool); later calls for it are no-ops."""
        problem = gpu_memory_problem(device_type)
        if problem:
            raise MooncakeError(problem)
        with self._lock:
            if self._registered.get(addr) == nbytes:
                return
            rc = self.engine.register_memory(addr, nbytes)
            if rc != 0:
                raise MooncakeError(f"registering {nbytes} bytes at {addr:#x} with Mooncake failed (rc={rc}); "
                                    "for rdma check memlock limits (ulimit -l) and the device")
            self._registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        """Forget a region registered for one push (a staging buffer); call it only once no
        write from it is in flight, and before the memory is freed."""
        with self._lock:
            if self._registered.pop(addr, None) is not None:
                self.engine.unregister_memory(addr)

    def write(self, target_session: str, writes: Sequence[Write],
              on_landed: Callable[[Write], None] | None = None) -> None:
        """Run every write one-sided into the target; returns once none is in flight.

        Each write is its own Mooncake batch, all submitted at once; on_landed(write) is
        called (in this thread) as each is in place at the target. Status is polled with
        naps paced by PollPacer, and each round looks only at the oldest POLL_WINDOW
        writes still pending (they land roughly in order; a status call costs a
        microsecond or two, and hundreds of writes per round would be a busy loop again).
        Mooncake's own batch_transfer_sync_write busy-polls, and on a 2-core host that
        spinning core is the one the TCP transport's I/O thread needs. Bounded by
        MC_TRANSFER_TIMEOUT (default 30 s) plus 1 s per GiB, as Mooncake's sync API is.
        Raises MooncakeError if any write failed, after all the submitted ones ended."""
        total = sum(w.length for w in writes)
        started = time.monotonic()
        deadline = started + _transfer_timeout_s() + total / (1 << 30)
        pending: list[tuple[int, Write]] = []
        problem = ""
        for w in writes:
            batch = self.engine.transfer_submit_write(target_session, w.src, w.dst, w.length)
            if batch in _INVALID_BATCH:
                problem = "could not submit a write (receiver's Transfer Engine unreachable?)"
                break  # submit nothing more; wait for what is already on the wire
            pending.append((batch, w))
        in_flight = sum(w.length for _, w in pending)
        while pending:
            still, looked = [], 0
            for batch, w in pending:
                if looked >= self.POLL_WINDOW:
                    still.append((batch, w))
                    continue
                status = self.engine.transfer_check_status(batch)  # frees the batch once it ended
                if status == _PENDING:
                    still.append((batch, w))
                    looked += 1
                    continue
                in_flight -= w.length
                if status == _COMPLETED:
                    if on_landed is not None:
                        on_landed(w)
                elif not problem:
                    problem = "a write failed" if status == _FAILED else "a write timed out"
            pending = still
            if not pending:
                break
            if time.monotonic() > deadline:
                # Mooncake cannot cancel a write: its batches stay allocated (a small leak, as
                # in Mooncake's own sync API); the receiver's quarantine covers late bytes.
                log.warning("Mooncake: %d writes to %s still pending at the deadline, giving up on them",
                            len(pending), target_session)
                problem = problem or f"{len(pending)} writes did not finish in time"
                break
            time.sleep(self.pacer.nap(in_flight))
        if problem:
            raise MooncakeError(f"one-sided write of {len(writes)} runs ({total} bytes) to {target_session} failed: "
                                f"{problem}; receiver gone, address not registered there, or transport error")
        self.pacer.observe(total, time.monotonic() - started)

    def close(self) -> None:
        with self._lock:
            for addr in list(self._registered):
                self.engine.unregister_memory(addr)
            self._registered.clear()
