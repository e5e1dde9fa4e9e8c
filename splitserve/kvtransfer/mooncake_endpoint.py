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

# Mooncake's TCP transport moves each write in slices over a few connections ("lanes")
# per peer, all driven by one I/O thread, and waits for the receiver's acknowledgement
# of each slice on its lane. Its defaults (64 KiB slices, 4 lanes) spend that thread on
# per-slice work; 1 MiB slices over 8 lanes measured best on loopback
# (docs/kv_transfer.md). Explicit environment settings win.
TCP_TUNING = {"MC_TCP_SLICE_SIZE": str(1 << 20), "MC_TCP_LANES_PER_PEER": "8"}

# transfer_check_status results, and the batch ids transfer_submit_write returns on failure.
_PENDING, _COMPLETED, _FAILED = 0, 1, -1
_INVALID_BATCH = (0, -1, (1 << 64) - 1)
_FIRST_NAP_S = 20e-6  # small transfers land in well under a millisecond
_MAX_NAP_S = 200e-6  # a poll costs a few µs: latency matters more


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

    def register(self, addr: int, nbytes: int) -> None:
        """Register a memory region once (the KV pool); later calls for it are no-ops."""
        with self._lock:
            if self._registered.get(addr) == nbytes:
                return
            rc = self.engine.register_memory(addr, nbytes)
            if rc != 0:
                raise MooncakeError(f"registering {nbytes} bytes at {addr:#x} with Mooncake failed (rc={rc}); "
                                    "for rdma check memlock limits (ulimit -l) and the device")
            self._registered[addr] = nbytes

    def write(self, target_session: str, writes: Sequence[Write],
              on_landed: Callable[[Write], None] | None = None) -> None:
        """Run every write one-sided into the target; returns once none is in flight.

        Each write is its own Mooncake batch, all submitted at once; on_landed(write) is
        called (in this thread) as each is in place at the target. Status is polled with
        growing naps, and each round looks only at the oldest POLL_WINDOW writes still
        pending (they land roughly in order; a status call costs a microsecond or two,
        and hundreds of writes per round would be a busy loop again). Mooncake's own
        batch_transfer_sync_write busy-polls, and on a 2-core host that spinning core is
        the one the TCP transport's I/O thread needs (bare loopback writes went from
        about 2.0 to 3.0 GB/s without it). Bounded by MC_TRANSFER_TIMEOUT (default 30 s)
        plus 1 s per GiB, as Mooncake's sync API is. Raises MooncakeError if any write
        failed, after all the submitted ones ended."""
        total = sum(w.length for w in writes)
        deadline = time.monotonic() + _transfer_timeout_s() + total / (1 << 30)
        pending: list[tuple[int, Write]] = []
        problem = ""
        for w in writes:
            batch = self.engine.transfer_submit_write(target_session, w.src, w.dst, w.length)
            if batch in _INVALID_BATCH:
                problem = "could not submit a write (receiver's Transfer Engine unreachable?)"
                break  # submit nothing more; wait for what is already on the wire
            pending.append((batch, w))
        nap = _FIRST_NAP_S
        while pending:
            still, looked, landed = [], 0, False
            for batch, w in pending:
                if looked >= self.POLL_WINDOW:
                    still.append((batch, w))
                    continue
                status = self.engine.transfer_check_status(batch)  # frees the batch once it ended
                if status == _PENDING:
                    still.append((batch, w))
                    looked += 1
                    continue
                landed = True
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
            nap = _FIRST_NAP_S if landed else min(nap * 2, _MAX_NAP_S)
            time.sleep(nap)
        if problem:
            raise MooncakeError(f"one-sided write of {len(writes)} runs ({total} bytes) to {target_session} failed: "
                                f"{problem}; receiver gone, address not registered there, or transport error")

    def close(self) -> None:
        with self._lock:
            for addr in list(self._registered):
                self.engine.unregister_memory(addr)
            self._registered.clear()
