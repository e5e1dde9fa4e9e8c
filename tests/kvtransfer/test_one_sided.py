"""The receiver's side of a one-sided (mooncake) push, driven by hand over a real gRPC
stream: written-block reports are verified as they come, a bad report fails the push
but is only answered at the commit (a writer may still be active until then), and the
lease gives its blocks back."""

from __future__ import annotations

import queue
import time

import grpc
import pytest
import torch
import xxhash

from splitserve.kvtransfer import create_sender, frames
from splitserve.kvtransfer.frames import LEASE_GRANTED, LEASE_METADATA_KEY, pb
from splitserve.kvtransfer.mooncake_sender import _Reports
from splitserve.kvtransfer.pool_io import RegionLayout, host_regions
from splitserve.kvtransfer.wire import ReceiverInfo, TransferHeader, dtype_name
from tests.kvtransfer import peer
from tests.kvtransfer.conftest import config_for, start_decode, wait_until


@pytest.fixture
def decode():
    d = start_decode(config_for("mooncake"))
    yield d
    d.receiver.stop()


class HandPush:
    """A PushBlocks stream whose messages the test sends one by one."""

    def __init__(self, decode, request_id: str, dest: list[int]):
        channel = grpc.insecure_channel(decode.address)
        info = ReceiverInfo.decode(frames.describe_stub(channel)(pb.DescribeRequest(), timeout=5).info)
        spec = decode.pool.spec
        header = TransferHeader(
            request_id=request_id, backend="mooncake", dest_block_ids=dest, block_hashes=[], layer_start=0,
            layer_end=spec.num_layers, dtype=dtype_name(spec.dtype), block_shape=list(spec.block_shape),
            region_nbytes=spec.block_nbytes, receiver_epoch=info.epoch)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox.put(frames.encode_header(header.encode()))
        self.call = frames.push_stub(channel).future(iter(self.outbox.get, None), timeout=10)
        granted = dict(self.call.initial_metadata()).get(LEASE_METADATA_KEY)
        assert granted == LEASE_GRANTED

    def send(self, raw: bytes) -> None:
        self.outbox.put(raw)

    def finish(self) -> pb.PushAck:
        self.outbox.put(None)
        return self.call.result(timeout=10)


def landed_sums(decode, dest: list[int]) -> list[int]:
    """What the receiver will compute for these blocks as they are now."""
    regions = host_regions(decode.pool, dest, RegionLayout.of(decode.pool))
    return [xxhash.xxh3_64_intdigest(r) for r in regions]


def write_source_blocks(decode, src: list[int], dest: list[int]) -> None:
    """Stand-in for the one-sided writes: put the source blocks into the destination slots."""
    source = peer.source_pool()
    for s, d in zip(src, dest, strict=True):
        decode.pool.data[d].copy_(source.data[s])


def test_blocks_reported_in_pieces_are_verified_and_committed(decode):
    dest = decode.allocate(3)
    fut = decode.expect("pieces", dest, [])
    write_source_blocks(decode, [2, 7, 4], dest)
    sums = landed_sums(decode, dest)
    push = HandPush(decode, "pieces", dest)
    push.send(frames.encode_written([2], [sums[2]]))
    push.send(frames.encode_written([0, 1], sums[:2], commit=True))
    ack = push.finish()
    assert ack.status == pb.PUSH_OK, ack
    outcome = fut.result(timeout=5)
    assert outcome.ok and outcome.nbytes == 3 * peer.SPEC.block_nbytes


@pytest.mark.parametrize("reports, message", [
    ([([5], [0])], "outside the transfer's 2 blocks"),
    ([([0], [0]), ([0], [0])], "reported written twice"),
    ([([0], [0])], "commit before stream blocks [1]"),
])
def test_malformed_reports_fail_the_push_but_are_answered_only_at_the_commit(decode, reports, message):
    start = decode.free()
    dest = decode.allocate(2)
    fut = decode.expect("malformed", dest, [])
    push = HandPush(decode, "malformed", dest)
    for indices, sums in reports:
        push.send(frames.encode_written(indices, sums))
    time.sleep(0.3)
    assert not push.call.done()  # the writer may still be writing: no answer before its commit
    push.send(frames.encode_commit())
    ack = push.finish()
    assert ack.status == pb.BAD_STREAM and message in ack.detail, ack
    outcome = fut.result(timeout=5)
    assert not outcome.ok and outcome.reason == "bad_stream"
    wait_until(lambda: decode.free() == start, what="blocks back after the one-sided quarantine")


def test_a_checksum_mismatch_in_a_report_allows_a_retry(decode):
    start = decode.free()
    dest = decode.allocate(2)
    fut = decode.expect("mismatch", dest, [])
    write_source_blocks(decode, [1, 2], dest)
    sums = landed_sums(decode, dest)
    push = HandPush(decode, "mismatch", dest)
    push.send(frames.encode_written([0, 1], [sums[0], sums[1] ^ 1], commit=True))
    ack = push.finish()
    assert ack.status == pb.CHECKSUM_MISMATCH and ack.retry_allowed, ack
    assert f"destination block {dest[1]}" in ack.detail
    assert not fut.done() and decode.free() == start - 2  # the lease waits for the retry

    retry = HandPush(decode, "mismatch", dest)
    retry.send(frames.encode_written([0, 1], sums, commit=True))
    assert retry.finish().status == pb.PUSH_OK
    assert fut.result(timeout=5).ok


def test_sender_reports_landed_blocks_in_batches_then_commits(decode, monkeypatch):
    """A real in-process MooncakeSender with a one-block report size: the receiver gets
    several `written` reports before the commit, and every block lands verified."""
    sent = []
    monkeypatch.setattr(_Reports, "REPORT_BYTES", peer.SPEC.block_nbytes)
    original = _Reports._send
    monkeypatch.setattr(_Reports, "_send", lambda self, commit: (sent.append((list(self.indices), commit)),
                                                                  original(self, commit)))
    source = peer.source_pool()
    dest = decode.allocate(5)
    src = [3, 11, 0, 7, 19]  # not adjacent: five separate writes
    fut = decode.expect("batched", dest, [])
    with create_sender("mooncake", config_for("mooncake")) as sender:
        result = sender.push("batched", decode.address, source, src, dest, [])
    assert result.attempts == 1 and fut.result(timeout=5).ok
    reported = sorted(i for indices, _ in sent for i in indices)
    assert reported == list(range(5)) and sent[-1][1] and sum(1 for _, commit in sent if not commit) >= 4
    for s, d in zip(src, dest, strict=True):
        assert decode.pool.data[d].view(torch.uint8).equal(source.data[s].view(torch.uint8))


def test_a_grpc_chunk_must_carry_the_checksums_of_the_blocks_it_completes():
    """grpc backend: each data chunk carries the xxh3 of the blocks whose last byte it holds."""
    d = start_decode(config_for("grpc"))
    try:
        start = d.free()
        dest = d.allocate(2)
        fut = d.expect("no-sums", dest, [])
        channel = grpc.insecure_channel(d.address)
        info = ReceiverInfo.decode(frames.describe_stub(channel)(pb.DescribeRequest(), timeout=5).info)
        spec = d.pool.spec
        header = TransferHeader(
            request_id="no-sums", backend="grpc", dest_block_ids=dest, block_hashes=[], layer_start=0,
            layer_end=spec.num_layers, dtype=dtype_name(spec.dtype), block_shape=list(spec.block_shape),
            region_nbytes=spec.block_nbytes, receiver_epoch=info.epoch)
        block = memoryview(bytes(spec.block_nbytes))
        stream = [frames.encode_header(header.encode()), frames.encode_data(0, [block], [0], [xxhash.xxh3_64_intdigest(block)]),
                  frames.encode_data(spec.block_nbytes, [block])]  # block 1 completes without its checksum
        ack = frames.push_stub(channel)(iter(stream), timeout=10)
        assert ack.status == pb.BAD_STREAM and "carries checksums for []" in ack.detail, ack
        assert fut.result(timeout=5).reason == "bad_stream"
        wait_until(lambda: d.free() == start, what="blocks back in the free list")
    finally:
        d.receiver.stop()
