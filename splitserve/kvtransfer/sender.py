"""KVSender: the prefill worker's end of KV transfer, one subclass per backend.

push() describes the receiver (cached per address), checks the KV layouts agree,
checksums the source blocks, then makes attempts through the backend until the
receiver acknowledges; a push whose blocks arrived corrupted is retried while the
receiver says the lease is still open. Everything runs under one deadline.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

import grpc

from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import frames
from splitserve.kvtransfer.config import BACKENDS, KVTransferConfig
from splitserve.kvtransfer.frames import pb
from splitserve.kvtransfer.malloc_tuning import reuse_message_buffers
from splitserve.kvtransfer.outcome import KVTransferError, PushResult
from splitserve.kvtransfer.pool_io import RegionLayout, host_regions
from splitserve.kvtransfer.wire import (
    ReceiverInfo,
    TransferHeader,
    WireError,
    check_layout,
    dtype_name,
)
from splitserve.metrics import Metrics

_RPC_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "receiver_busy",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
}


class KVSender(ABC):
    backend = ""

    def __init__(self, config: KVTransferConfig | None = None, metrics: Metrics | None = None):
        self.config = config or KVTransferConfig(backend=self.backend)
        reuse_message_buffers(self.config.message_limit)
        self.metrics = metrics
        self._channels: dict[str, grpc.Channel] = {}
        self._infos: dict[str, ReceiverInfo] = {}
        self._lock = threading.Lock()

    def push(self, request_id: str, receiver_address: str, src_pool: KVCachePool, src_block_ids: Sequence[int],
             dest_block_ids: Sequence[int], block_hashes: Sequence[int], layer_range: tuple[int, int] | None = None,
             timeout: float | None = None) -> PushResult:
        """Copy src_block_ids of src_pool into the receiver's dest_block_ids (leased there by
        expect() for request_id). Returns when the receiver verified every block; raises
        KVTransferError otherwise (the receiver then frees its blocks on its own)."""
        _check_request(request_id, src_pool, src_block_ids, dest_block_ids, block_hashes)
        layout = RegionLayout.of(src_pool, layer_range)
        start = time.monotonic()
        deadline = start + (timeout if timeout is not None else self.config.timeout_s)
        try:
            info = self._describe(receiver_address, request_id, deadline)
            check_layout(src_pool.spec, info, request_id)
            regions = host_regions(src_pool, src_block_ids, layout)
            header = TransferHeader(
                request_id=request_id, backend=self.backend, dest_block_ids=[int(b) for b in dest_block_ids],
                block_hashes=[int(h) for h in block_hashes], layer_start=layout.layer_start,
                layer_end=layout.layer_end, dtype=dtype_name(src_pool.spec.dtype),
                block_shape=list(src_pool.spec.block_shape), region_nbytes=layout.region_nbytes,
                receiver_epoch=info.epoch)
            attempt, described_again = 0, False
            while True:
                attempt += 1
                ack = self._attempt(receiver_address, info, header, src_pool, src_block_ids, layout, regions, deadline)
                if ack.status == pb.PUSH_OK:
                    return self._done(request_id, receiver_address, header.total_nbytes, start, attempt)
                status = pb.PushStatus.Name(ack.status)
                if ack.status == pb.BAD_HEADER and ack.retry_allowed and not described_again:
                    # the decode worker restarted at this address since we described it: once
                    # more, not counted in max_attempts (the receiver wrote nothing)
                    info, header = self._describe_again(receiver_address, request_id, deadline, src_pool, header)
                    described_again = True
                    continue
                retry = ack.status == pb.CHECKSUM_MISMATCH and ack.retry_allowed
                if not retry or attempt - described_again >= self.config.max_attempts:
                    raise KVTransferError(request_id, receiver_address, status.lower(), ack.detail)
        except grpc.RpcError as exc:
            reason = _RPC_REASONS.get(exc.code(), "rpc_error")
            detail = exc.details() or str(exc.code())
            if reason == "deadline":
                detail = f"no acknowledgement within {deadline - start:.1f}s ({detail}); is the decode worker alive?"
            elif "larger than max" in detail:
                reason = "message_too_large"
                detail += ("; prefill and decode workers must use the same kv transfer chunk_bytes / "
                           "max_message_bytes")
            self._failed(receiver_address, reason)
            raise KVTransferError(request_id, receiver_address, reason, detail) from None
        except WireError as exc:
            self._failed(receiver_address, "layout_mismatch")
            raise KVTransferError(request_id, receiver_address, "layout_mismatch", str(exc)) from None
        except KVTransferError as exc:
            self._failed(receiver_address, exc.reason)
            raise

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._infos.clear()

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- for backends -----------------------------------------------------------------
    @abstractmethod
    def _attempt(self, address: str, info: ReceiverInfo, header: TransferHeader, src_pool: KVCachePool,
                 src_block_ids: Sequence[int], layout: RegionLayout, regions: list[memoryview],
                 deadline: float) -> pb.PushAck:
        """One push of every block; returns the receiver's acknowledgement."""

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self.config.security.sync_channel(address, self.config.grpc_options())
                self._channels[address] = channel
            return channel

    @staticmethod
    def _remaining(deadline: float, request_id: str, address: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTransferError(request_id, address, "deadline", "the push ran out of time before its next step")
        return left

    # ---- internals ----------------------------------------------------------------------
    def _describe(self, address: str, request_id: str, deadline: float) -> ReceiverInfo:
        with self._lock:
            info = self._infos.get(address)
        if info is not None:
            return info
        reply = frames.describe_stub(self._channel(address))(
            pb.DescribeRequest(), timeout=self._remaining(deadline, request_id, address),
            metadata=self.config.security.metadata)
        info = ReceiverInfo.decode(reply.info)
        with self._lock:
            self._infos[address] = info
        return info

    def _describe_again(self, address: str, request_id: str, deadline: float, src_pool: KVCachePool,
                        header: TransferHeader) -> tuple[ReceiverInfo, TransferHeader]:
        with self._lock:
            self._infos.pop(address, None)
        info = self._describe(address, request_id, deadline)
        check_layout(src_pool.spec, info, request_id)
        return info, dataclasses.replace(header, receiver_epoch=info.epoch)

    def _done(self, request_id: str, address: str, nbytes: int, start: float, attempts: int) -> PushResult:
        seconds = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.kv_transfer_bytes.labels(backend=self.backend, direction="sent").inc(nbytes)
            self.metrics.kv_transfer_seconds.labels(backend=self.backend).observe(seconds)
        return PushResult(request_id, address, nbytes, seconds, attempts)

    def _failed(self, address: str, reason: str) -> None:
        with self._lock:  # the receiver may have restarted: describe it afresh next time
            self._infos.pop(address, None)
        if self.metrics is not None:
            self.metrics.kv_transfer_errors.labels(backend=self.backend, reason=reason).inc()


def _check_request(request_id: str, pool: KVCachePool, src: Sequence[int], dest: Sequence[int],
                   hashes: Sequence[int]) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
    if not src:
        raise ValueError(f"request {request_id!r}: nothing to push (no source blocks)")
    if len(src) != len(dest):
        raise ValueError(f"request {request_id!r}: {len(src)} source blocks but {len(dest)} destination blocks")
    if len(hashes) > len(src):
        raise ValueError(f"request {request_id!r}: {len(hashes)} block hashes for {len(src)} blocks")
    bad = [b for b in src if not 0 <= int(b) < pool.num_blocks]
    if bad:
        raise ValueError(f"request {request_id!r}: source blocks {bad[:8]} are outside the pool (0..{pool.num_blocks - 1})")


def create_sender(backend: str, config: KVTransferConfig | None = None, metrics: Metrics | None = None) -> KVSender:
    """The sender for a backend name ("grpc" or "mooncake")."""
    if backend not in BACKENDS:
        raise ValueError(f"kv transfer backend {backend!r} is not one of {BACKENDS}")
    if config is not None and config.backend != backend:
        raise ValueError(f"create_sender({backend!r}) got a config for backend {config.backend!r}")
    if backend == "grpc":
        from splitserve.kvtransfer.grpc_sender import GrpcSender as cls
    else:
        from splitserve.kvtransfer.mooncake_sender import MooncakeSender as cls
    return cls(config, metrics)
