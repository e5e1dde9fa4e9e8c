"""The bare transports of `splitserve bench kvtransfer`: what the libraries alone do.

grpc: a client stream of the same 1-copy chunks into a sink that copies them into the
destination blocks, with no checksums, lease or acknowledgement protocol. mooncake: the
same coalesced one-sided writes, without the PushBlocks stream around them. Comparing
them with the real push shows what our protocol costs over the library.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent import futures

import grpc
import msgpack
import torch

from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer.config import KVTransferConfig
from splitserve.kvtransfer.grpc_sender import chunk_parts, chunk_plan
from splitserve.kvtransfer.mooncake_sender import plan_writes
from splitserve.kvtransfer.pool_io import RegionLayout, host_regions, pool_bytes, split_span
from splitserve.kvtransfer.wire import ReceiverInfo

_METHOD = "/splitserve.bench.BareSink/Push"
# the sink only reads gRPC's buffer (it is the source of a copy into the pool)
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)
BarePush = Callable[[KVCachePool, list[int], list[int]], None]


class BareSink:
    """Decode side of the bare grpc stream: first message msgpack(dest ids), then chunks."""

    def __init__(self, pool: KVCachePool, config: KVTransferConfig):
        self.pool = pool
        self.config = config
        self._server: grpc.Server | None = None

    def start(self) -> str:
        handler = grpc.method_handlers_generic_handler("splitserve.bench.BareSink", {
            "Push": grpc.stream_unary_rpc_method_handler(self._push)})
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=self.config.grpc_options())
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return f"127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0).wait()

    def _push(self, stream, context) -> bytes:
        dest = msgpack.unpackb(next(stream))
        layout = RegionLayout.of(self.pool)
        flat = pool_bytes(self.pool)
        offset = 0
        for chunk in stream:
            for index, within, at, n in split_span(offset, len(chunk), layout.region_nbytes):
                start = layout.offset(dest[index]) + within
                flat[start:start + n].copy_(torch.frombuffer(memoryview(chunk)[at:at + n], dtype=torch.uint8))
            offset += len(chunk)
        return b""


def bare_grpc_push(sink_address: str, config: KVTransferConfig) -> BarePush:
    channel = grpc.insecure_channel(sink_address, options=config.grpc_options())
    call = channel.stream_unary(_METHOD)

    def push(src: KVCachePool, src_ids: list[int], dest: list[int]) -> None:
        regions = host_regions(src, src_ids, RegionLayout.of(src))

        def messages():
            yield msgpack.packb(dest)
            for offset, length in chunk_plan(len(regions[0]), len(regions), config.chunk_bytes):
                yield b"".join(chunk_parts(regions, offset, length))
        call(messages(), timeout=120)
    return push


def bare_mooncake_push(sender, receiver_address: str) -> BarePush:
    """Uses the sender's own Transfer Engine (same connections as its real pushes)."""
    def push(src: KVCachePool, src_ids: list[int], dest: list[int]) -> None:
        info: ReceiverInfo = sender._describe(receiver_address, "bare", time.monotonic() + 30)
        writes = plan_writes(src, src_ids, dest, RegionLayout.of(src), info.pool_base)
        sender._endpoint_for(src).write(info.mooncake_session, writes)
    return push
