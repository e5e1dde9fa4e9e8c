"""Settings of one KV transfer endpoint (sender or receiver), validated up front."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.security.links import NO_SECURITY, LinkSecurity

BACKENDS = ("grpc", "mooncake")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
GRPC_DEFAULT_MAX_MESSAGE = 4 << 20  # gRPC's own default receive limit
_FRAME_OVERHEAD = 64 << 10  # room for the frame's tag/length/offset fields


@dataclass(frozen=True)
class KVTransferConfig:
    backend: str = "grpc"
    # Receiver's gRPC listen address (port 0 = pick a free one).
    host: str = "127.0.0.1"
    port: int = 0
    # grpc backend: bytes of KV per streamed message. 1 MiB measured fastest on loopback
    # (smaller messages pipeline better through gRPC than large ones; see
    # docs/kv_transfer.md). Above 4 MiB the gRPC message limit is raised to match.
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 0  # 0 = derived from chunk_bytes
    # Deadline of one push (sender) and default lifetime of one lease (receiver).
    timeout_s: float = 30.0
    # Pushes of one request whose checksums fail before the lease is given up.
    max_attempts: int = 3
    # Concurrent PushBlocks streams a receiver serves; more are refused
    # (RESOURCE_EXHAUSTED) instead of queueing unbounded memory.
    max_concurrent_pushes: int = 16
    # ...and from one peer (one gRPC connection, i.e. one prefill worker), so a stuck or
    # flooding sender cannot take every slot.
    max_pushes_per_peer: int = 8
    # A stream that sends nothing (not even its header) for this long is cancelled and its
    # slot freed; a live sender sends a chunk or a written-block report far more often.
    push_idle_timeout_s: float = 10.0
    # mooncake backend.
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""  # RDMA device name(s), e.g. "mlx5_0"; "" = auto
    # How long a failed one-sided transfer's blocks stay reserved after the sender's
    # stream ended, so that a write already on the wire cannot land in blocks that
    # were handed to another request (one-sided writes cannot be recalled).
    one_sided_quarantine_s: float = 2.0
    # Mutual TLS and/or the cluster token on the gRPC stream (PushBlocks/Describe). Mooncake's
    # one-sided data path is not covered (its TCP/RDMA transport has neither).
    security: LinkSecurity = NO_SECURITY

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"kv transfer backend {self.backend!r} is not one of {BACKENDS}")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"mooncake protocol {self.mooncake_protocol!r} is not one of {MOONCAKE_PROTOCOLS}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} is too small; use at least 4096 (MiBs are typical)")
        if self.max_message_bytes and self.max_message_bytes < self.chunk_bytes + _FRAME_OVERHEAD:
            raise ValueError(
                f"max_message_bytes={self.max_message_bytes} cannot carry chunk_bytes={self.chunk_bytes}; "
                f"set it to at least {self.chunk_bytes + _FRAME_OVERHEAD} or leave it 0")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_concurrent_pushes < 1:
            raise ValueError(f"max_concurrent_pushes must be at least 1, got {self.max_concurrent_pushes}")
        if self.max_pushes_per_peer < 1:
            raise ValueError(f"max_pushes_per_peer must be at least 1, got {self.max_pushes_per_peer}")
        if self.push_idle_timeout_s <= 0:
            raise ValueError(f"push_idle_timeout_s must be positive, got {self.push_idle_timeout_s}")
        if self.one_sided_quarantine_s < 0:
            raise ValueError(f"one_sided_quarantine_s must be >= 0, got {self.one_sided_quarantine_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is out of range")

    @property
    def message_limit(self) -> int:
        """gRPC max send/receive message size both ends are configured with."""
        if self.max_message_bytes:
            return self.max_message_bytes
        return max(GRPC_DEFAULT_MAX_MESSAGE, self.chunk_bytes + _FRAME_OVERHEAD)

    def grpc_options(self) -> list[tuple[str, int]]:
        limit = self.message_limit
        return [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]
