"""The KVTransfer gRPC service on the wire: KVChunk frames and the method bindings.

KVChunk (splitserve/proto/kvtransfer.proto) is encoded and decoded here by hand
because it carries the bulk bytes: the generated class would copy every chunk into
the message and again into the serialized string on the sender, and once more out of
the parsed message on the receiver. Here a chunk is assembled with one join straight
from the source blocks, and decoded as a zero-copy memoryview of gRPC's buffer. The
encoding is standard protobuf (tests check it against the generated class), so any
protobuf client can talk to a receiver. The small messages use the generated classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from splitserve.proto.build import ensure_built

ensure_built()
from splitserve.proto import kvtransfer_pb2 as pb  # noqa: E402

SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name
PUSH_METHOD = f"/{SERVICE}/PushBlocks"
DESCRIBE_METHOD = f"/{SERVICE}/Describe"

# Sent by the receiver as initial metadata once a one-sided push holds its lease: the
# sender writes nothing before it (blocks not leased to the request stay untouched).
LEASE_METADATA_KEY = "x-splitserve-lease"
LEASE_GRANTED = "granted"

_HEADER_TAG, _OFFSET_TAG, _DATA_TAG, _COMMIT_TAG = b"\x0a", b"\x10", b"\x1a", b"\x20"
_WRITTEN_TAG, _WRITTEN_SUMS_TAG = b"\x2a", b"\x32"  # packed repeated fields 5 and 6
_WRITTEN, _WRITTEN_SUMS = 5, 6


class FrameError(ValueError):
    """A PushBlocks message that is not a well-formed KVChunk."""


@dataclass(frozen=True)
class Frame:
    header: bytes | None = None
    offset: int = 0
    data: memoryview | None = None
    commit: bool = False
    # Stream indices of blocks completed by this chunk (grpc) or now in place (mooncake),
    # and their xxh3_64 in the same order.
    written: tuple[int, ...] = ()
    written_checksums: tuple[int, ...] = ()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise FrameError("truncated or oversized varint in KVChunk")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def encode_header(raw_header: bytes) -> bytes:
    return _HEADER_TAG + _varint(len(raw_header)) + raw_header


def encode_data(offset: int, parts: Sequence[memoryview], completed: Sequence[int] = (),
                sums: Sequence[int] = ()) -> bytes:
    """One data chunk: `parts` (views of source blocks) joined with a single copy, with the
    stream indices and xxh3 of the blocks whose last byte is in this chunk."""
    n = sum(len(p) for p in parts)
    prefix = _OFFSET_TAG + _varint(offset) + _DATA_TAG + _varint(n)
    return b"".join([prefix, *parts, _packed(completed, sums)])


def encode_commit() -> bytes:
    return _COMMIT_TAG + b"\x01"


def encode_written(indices: Sequence[int], sums: Sequence[int], commit: bool = False) -> bytes:
    """A one-sided push's report: these stream blocks landed and have these checksums."""
    return _packed(indices, sums) + (encode_commit() if commit else b"")


def _packed(indices: Sequence[int], sums: Sequence[int]) -> bytes:
    if not indices:
        return b""
    out = []
    for tag, values in ((_WRITTEN_TAG, indices), (_WRITTEN_SUMS_TAG, sums)):
        packed = b"".join(_varint(v) for v in values)
        out += [tag, _varint(len(packed)), packed]
    return b"".join(out)


def _read_packed(buf: memoryview, pos: int, end: int) -> list[int]:
    values = []
    while pos < end:
        value, pos = _read_varint(buf, pos)
        values.append(value)
    if pos != end:
        raise FrameError("KVChunk packed field ends inside a varint")
    return values


def decode(raw: bytes) -> Frame:
    """Parse one KVChunk; unknown fields are skipped as protobuf requires."""
    buf = memoryview(raw)
    pos, header, offset, data, commit = 0, None, 0, None, False
    repeated: dict[int, list[int]] = {_WRITTEN: [], _WRITTEN_SUMS: []}
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buf, pos)
            if number == 2:
                offset = value
            elif number == 4:
                commit = bool(value)
            elif number in repeated:  # an unpacked encoder; protobuf parsers accept both
                repeated[number].append(value)
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise FrameError(f"KVChunk field {number} claims {length} bytes, only {len(buf) - pos} left")
            if number == 1:
                header = bytes(buf[pos:pos + length])
            elif number == 3:
                data = buf[pos:pos + length]
            elif number in repeated:
                repeated[number] += _read_packed(buf, pos, pos + length)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise FrameError(f"KVChunk field {number} has unsupported wire type {wire_type}")
    if pos != len(buf):
        raise FrameError("KVChunk ends inside a field")
    written, sums = repeated[_WRITTEN], repeated[_WRITTEN_SUMS]
    if len(written) != len(sums):
        raise FrameError(f"KVChunk reports {len(written)} written blocks but {len(sums)} checksums")
    return Frame(header=header, offset=offset, data=data, commit=commit,
                 written=tuple(written), written_checksums=tuple(sums))


def _decode_or_marker(raw: bytes) -> Frame | FrameError:
    # A deserializer that raises kills the RPC with an opaque INTERNAL error; hand
    # the error to the handler instead so it can answer BAD_STREAM naming the request.
    try:
        return decode(raw)
    except FrameError as exc:
        return exc


def _identity(raw: bytes) -> bytes:
    return raw


def server_handler(push_blocks: Callable, describe: Callable) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "PushBlocks": grpc.stream_unary_rpc_method_handler(
            push_blocks, request_deserializer=_decode_or_marker,
            response_serializer=pb.PushAck.SerializeToString),
        "Describe": grpc.unary_unary_rpc_method_handler(
            describe, request_deserializer=pb.DescribeRequest.FromString,
            response_serializer=pb.DescribeReply.SerializeToString),
    })


def push_stub(channel: grpc.Channel) -> grpc.StreamUnaryMultiCallable:
    """Takes an iterator of already-encoded KVChunk bytes."""
    return channel.stream_unary(PUSH_METHOD, request_serializer=_identity,
                                response_deserializer=pb.PushAck.FromString)


def describe_stub(channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(DESCRIBE_METHOD, request_serializer=pb.DescribeRequest.SerializeToString,
                               response_deserializer=pb.DescribeReply.FromString)
