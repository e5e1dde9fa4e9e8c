"""The other process in KV transfer tests: a prefill-side sender or a decode-side receiver,
run in a spawned child and driven over a multiprocessing pipe.

Faults are injected by subclassing the real senders (no test hooks in production
code): `corrupt` flips a byte on its way, after its checksum was taken (grpc: in the
last encoded chunk; mooncake: the last region is written from a flipped copy), `slow` pauses after the first
bytes, `stall` stops after the first bytes and never continues (the test kills it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.kvtransfer import KVReceiver, KVTransferConfig, KVTransferError
from splitserve.kvtransfer.grpc_sender import GrpcSender
from splitserve.kvtransfer.mooncake_sender import MooncakeSender

# 16 KiB blocks: 4 layers x (K, V) x 16 tokens x 2 heads x 32 dims x bf16.
SPEC = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.bfloat16)
SOURCE_BLOCKS = 24
SEED = 1234


def source_pool(num_blocks: int = SOURCE_BLOCKS, seed: int = SEED) -> KVCachePool:
    """The prefill pool both processes can rebuild bit-for-bit."""
    pool = KVCachePool(SPEC, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen).to(SPEC.dtype))
    return pool


class _Faults:
    behaviour = "normal"
    progress = None  # multiprocessing Event, set once the first bytes are on their way
    corrupted = 0

    def _corrupt_now(self) -> bool:
        """Whether this attempt's bytes get corrupted on their way (counted)."""
        if not self.behaviour.startswith("corrupt") or (self.behaviour == "corrupt_once" and self.corrupted):
            return False
        self.corrupted += 1
        return True

    def _pause(self) -> None:
        self.progress.set()
        if self.behaviour == "slow":
            time.sleep(1.0)
        elif self.behaviour == "stall":
            threading.Event().wait()  # until the test kills this process


class FaultyGrpcSender(_Faults, GrpcSender):
    # Checksums are taken from the source as each chunk is built, so corruption is made on
    # the "wire": a byte of the last chunk's data flipped after it was encoded.
    def _frames(self, header, regions):
        encoded = list(super()._frames(header, regions))
        if self._corrupt_now():
            last = bytearray(encoded[-1])
            last[len(last) // 2] ^= 0x5A  # the middle of a chunk is data (its checksums trail it)
            encoded[-1] = bytes(last)
        for i, frame in enumerate(encoded):
            yield frame
            if i == 1 and self.behaviour in ("slow", "stall"):  # header + first chunk sent
                self._pause()


class FaultyMooncakeSender(_Faults, MooncakeSender):
    # Checksums are taken from the source as writes land, so corruption is made on the
    # "wire" instead: the write of the last region comes from a flipped copy.
    def _plan_writes(self, endpoint, src_pool, src_block_ids, header, layout, info, regions):
        planned = super()._plan_writes(endpoint, src_pool, src_block_ids, header, layout, info, regions)
        if not self._corrupt_now():
            return planned
        writes = planned.writes
        last = writes[-1]
        if getattr(self, "_garbled", None) is None:  # registered once: Mooncake refuses overlapping regions
            self._garbled = torch.empty(src_pool.nbytes, dtype=torch.uint8)
            endpoint.register(self._garbled.data_ptr(), src_pool.nbytes)
        self._garbled[:last.length] = torch.frombuffer(bytearray(ctypes.string_at(last.src, last.length)),
                                                       dtype=torch.uint8)
        self._garbled[last.length - layout.region_nbytes // 2] ^= 0x5A  # inside the last region
        return dataclasses.replace(planned, writes=[*writes[:-1], last._replace(src=self._garbled.data_ptr())])

    def _write(self, call, outbox, attempt, endpoint, session, writes, reports):
        if self.behaviour == "stall":
            dict(call.initial_metadata() or ())  # lease granted: the stream is attached
            first = writes.writes[0]
            endpoint.write(session, [first._replace(length=min(first.length, 4096))])
            self._pause()
        if self.behaviour == "slow":
            self._pause()
        return super()._write(call, outbox, attempt, endpoint, session, writes, reports)


def sender_main(conn, backend: str, config: KVTransferConfig, progress) -> None:
    cls = FaultyGrpcSender if backend == "grpc" else FaultyMooncakeSender
    sender = cls(config)
    sender.progress = progress
    pool = source_pool()
    while (msg := conn.recv()) is not None:
        sender.behaviour = msg.pop("behaviour", "normal")
        sender.corrupted = 0
        start = time.monotonic()
        try:
            result = sender.push(src_pool=pool, **msg)
            conn.send({"ok": True, "attempts": result.attempts, "nbytes": result.nbytes,
                       "seconds": time.monotonic() - start})
        except KVTransferError as exc:
            conn.send({"ok": False, "reason": exc.reason, "detail": str(exc), "seconds": time.monotonic() - start})
    sender.close()


def receiver_main(conn, config: KVTransferConfig, num_blocks: int) -> None:
    """A decode side with a real BlockManager; commands: expect, free, outcome."""
    pool = KVCachePool(SPEC, num_blocks)
    blocks = BlockManager(num_blocks, SPEC.block_size)
    lock = threading.Lock()

    def release(ids):
        with lock:
            blocks.release_blocks(ids)

    receiver = KVReceiver(pool, config, worker_id="test-decode-child")
    conn.send(receiver.start())
    futures = {}
    while (msg := conn.recv()) is not None:
        cmd, *args = msg
        if cmd == "expect":
            request_id, n, timeout = args
            with lock:
                ids = blocks.allocate_blocks(n)
            futures[request_id] = receiver.expect(request_id, ids, [], release, timeout=timeout)
            conn.send(ids)
        elif cmd == "free":
            with lock:
                conn.send(blocks.num_free_blocks)
        elif cmd == "outcome":
            result = futures[args[0]].result(timeout=args[1])
            conn.send((result.ok, result.reason))
    receiver.stop()
