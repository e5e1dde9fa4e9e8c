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
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Mooncake's TCP transport moves each write in slices over a few connections ("lanes")
# per peer, all driven by one I/O thread. Its defaults (64 KiB slices, 4 lanes) spend
# that thread on per-slice callbacks; 1 MiB slices over 8 lanes measured about twice
# the throughput on loopback (docs/kv_transfer.md). Explicit environment settings win.
TCP_TUNING = {"MC_TCP_SLICE_SIZE": str(1 << 20), "MC_TCP_LANES_PER_PEER": "8"}


class MooncakeError(RuntimeError):
    pass


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


class MooncakeEndpoint:
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

    def write(self, target_session: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """One-sided write of every (src, dst, length) triple; blocks until all landed.
        Bounded by Mooncake's own transfer timeout (MC_TRANSFER_TIMEOUT, default 30 s)."""
        rc = self.engine.batch_transfer_sync_write(target_session, list(src), list(dst), list(lengths))
        if rc != 0:
            raise MooncakeError(f"one-sided write of {len(src)} regions ({sum(lengths)} bytes) to {target_session} "
                                f"failed (rc={rc}): receiver gone, address not registered there, or transport error")

    def close(self) -> None:
        with self._lock:
            for addr in list(self._registered):
                self.engine.unregister_memory(addr)
            self._registered.clear()


def coalesce(src: Sequence[int], dst: Sequence[int], length: int) -> tuple[list[int], list[int], list[int]]:
    """Merge regions adjacent on both sides into single writes (fewer, larger transfers)."""
    out_src: list[int] = []
    out_dst: list[int] = []
    out_len: list[int] = []
    for s, d in zip(src, dst, strict=True):
        if out_src and out_src[-1] + out_len[-1] == s and out_dst[-1] + out_len[-1] == d:
            out_len[-1] += length
        else:
            out_src.append(s)
            out_dst.append(d)
            out_len.append(length)
    return out_src, out_dst, out_len
