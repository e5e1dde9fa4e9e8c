"""The pure pieces: KVChunk frames against the generated protobuf class, the msgpack
header, chunking and region arithmetic, config validation."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from splitserve.engine.kv_cache import KVCachePool
from splitserve.kvtransfer import KVTransferConfig, frames
from splitserve.kvtransfer.frames import FrameError, pb
from splitserve.kvtransfer.grpc_sender import chunk_parts, chunk_plan
from splitserve.kvtransfer.mooncake_endpoint import Write, coalesce
from splitserve.kvtransfer.pool_io import RegionLayout, StreamWriter, host_regions, split_span
from splitserve.kvtransfer.wire import TransferHeader, WireError, validate_header
from tests.kvtransfer import peer


def header(**overrides) -> TransferHeader:
    values = dict(request_id="r", backend="grpc", dest_block_ids=[3, 1], block_hashes=[7], layer_start=0,
                  layer_end=4, dtype="bfloat16", block_shape=list(peer.SPEC.block_shape),
                  region_nbytes=peer.SPEC.block_nbytes, receiver_epoch="e")
    values.update(overrides)
    return TransferHeader(**values)


def test_hand_encoded_frames_are_standard_kvchunk_messages():
    data = memoryview(bytes(range(256)) * 40)
    encoded = frames.encode_data(1 << 40, [data[:100], data[100:5000]])
    parsed = pb.KVChunk.FromString(encoded)
    assert parsed.offset == 1 << 40 and parsed.data == bytes(data[:5000]) and not parsed.header
    with_sums = pb.KVChunk.FromString(frames.encode_data(8, [data[:16]], [3, 4], [7, (1 << 64) - 1]))
    assert with_sums.data == bytes(data[:16]) and list(with_sums.written) == [3, 4]
    assert list(with_sums.written_checksums) == [7, (1 << 64) - 1]
    assert pb.KVChunk.FromString(frames.encode_header(b"hdr")).header == b"hdr"
    assert pb.KVChunk.FromString(frames.encode_commit()).commit
    # ...and what any protobuf client sends decodes here, unknown fields skipped.
    msg = pb.KVChunk(header=b"h", offset=300, data=b"xyz", commit=True).SerializeToString() + b"\x78\x05"
    frame = frames.decode(msg)
    assert (frame.header, frame.offset, bytes(frame.data), frame.commit) == (b"h", 300, b"xyz", True)


def test_written_reports_round_trip_through_protobuf():
    sums = [0, (1 << 64) - 1, 12345]
    raw = frames.encode_written([0, 7, 300], sums, commit=True)
    parsed = pb.KVChunk.FromString(raw)
    assert list(parsed.written) == [0, 7, 300] and list(parsed.written_checksums) == sums and parsed.commit
    frame = frames.decode(raw)
    assert frame.written == (0, 7, 300) and frame.written_checksums == tuple(sums) and frame.commit
    # the commit alone, and another encoder's unpacked repeated fields, decode the same way
    assert frames.decode(frames.encode_written([], [], commit=True)) == frames.decode(frames.encode_commit())
    unpacked = b"\x28\x03\x30\x09"  # written=3, written_checksums=9 as plain varints
    assert frames.decode(unpacked).written == (3,) and frames.decode(unpacked).written_checksums == (9,)


@pytest.mark.parametrize("raw", [b"\x1a\x05ab", b"\x10", b"\x0f", b"\x1a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                 b"\x2a\x01\x01", b"\x2a\x01\x80"])
def test_malformed_frames_raise_frame_error(raw):
    with pytest.raises(FrameError):
        frames.decode(raw)


def test_header_round_trip_and_rejections():
    h = header()
    assert TransferHeader.decode(h.encode()) == h
    assert h.total_nbytes == 2 * peer.SPEC.block_nbytes
    with pytest.raises(WireError, match="not valid msgpack"):
        TransferHeader.decode(b"\xc1")
    with pytest.raises(WireError, match="version"):
        TransferHeader.decode(msgpack.packb({**dataclasses.asdict(h), "version": 99}))
    with pytest.raises(WireError, match="wrong fields"):
        TransferHeader.decode(msgpack.packb({**dataclasses.asdict(h), "surprise": 1}))
    with pytest.raises(WireError, match="list of integers"):
        TransferHeader.decode(header(dest_block_ids=["3", 1]).encode())
    with pytest.raises(WireError, match="wrong fields"):  # a version-1 header still had checksums
        TransferHeader.decode(msgpack.packb({**dataclasses.asdict(h), "checksums": [11, 12]}))
    with pytest.raises(WireError, match="unknown backend"):
        TransferHeader.decode(header(backend="nccl").encode())
    with pytest.raises(WireError, match="repeat"):
        TransferHeader.decode(header(dest_block_ids=[1, 1]).encode())


def test_validate_header_against_the_pool():
    spec = peer.SPEC
    assert validate_header(header(), spec, 8, "e") is None
    assert "epoch" in validate_header(header(receiver_epoch="old"), spec, 8, "e")
    assert "does not match" in validate_header(header(dtype="float16"), spec, 8, "e")
    assert "outside the pool" in validate_header(header(dest_block_ids=[3, 8]), spec, 8, "e")
    assert "region_nbytes" in validate_header(header(layer_end=2), spec, 8, "e")
    assert "exceeds" in validate_header(header(layer_end=5), spec, 8, "e")


def test_split_span_and_chunk_plan():
    assert split_span(0, 10, 4) == [(0, 0, 0, 4), (1, 0, 4, 4), (2, 0, 8, 2)]
    assert split_span(6, 5, 4) == [(1, 2, 0, 2), (2, 0, 2, 3)]
    # chunks hold whole regions when they fit, split regions otherwise
    assert chunk_plan(4, 5, 9) == [(0, 8), (8, 8), (16, 4)]
    assert chunk_plan(10, 2, 4) == [(0, 4), (4, 4), (8, 4), (12, 4), (16, 4)]
    regions = [memoryview(b"aaaa"), memoryview(b"bbbb"), memoryview(b"cccc")]
    assert b"".join(chunk_parts(regions, 2, 7)) == b"aabbbbc"


def test_coalesce_merges_only_regions_adjacent_on_both_sides():
    assert coalesce([0, 10, 20, 50], [100, 110, 130, 140], 10) == [
        Write(src=0, dst=100, length=20, first=0, count=2), Write(20, 130, 10, 2, 1), Write(50, 140, 10, 3, 1)]


def test_stream_writer_places_layer_ranges_and_reports_digests():
    pool = KVCachePool(peer.SPEC, 6)
    src = peer.source_pool()
    layout = RegionLayout.of(pool, (1, 3))
    regions = host_regions(src, [4, 9], layout)
    stream = b"".join(regions)
    writer = StreamWriter(pool, [5, 0], layout)
    done = writer.write(0, memoryview(stream)[:1000]) + writer.write(1000, memoryview(stream)[1000:])
    assert [i for i, _ in done] == [0, 1]
    assert torch.equal(pool.data[5, 1:3], src.data[4, 1:3]) and torch.equal(pool.data[0, 1:3], src.data[9, 1:3])
    assert not pool.data[5, 0].view(torch.uint8).any() and not pool.data[5, 3].view(torch.uint8).any()
    with pytest.raises(ValueError, match="received so far"):
        writer.write(5, memoryview(b"x"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend="nccl"), "not one of"),
    (dict(mooncake_protocol="ucx"), "mooncake protocol"),
    (dict(chunk_bytes=100), "too small"),
    (dict(chunk_bytes=8 << 20, max_message_bytes=4 << 20), "cannot carry"),
    (dict(timeout_s=0), "positive"),
    (dict(max_attempts=0), "at least 1"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(**kwargs)


def test_config_raises_grpc_limit_with_chunk_size():
    assert KVTransferConfig(chunk_bytes=1 << 20).message_limit == 4 << 20
    assert KVTransferConfig(chunk_bytes=16 << 20).message_limit > 16 << 20
