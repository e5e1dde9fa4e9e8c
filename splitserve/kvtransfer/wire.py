"""What travels with a transfer: the header (msgpack) and the receiver's self-description.

A transfer moves, for each block, the bytes of layers [layer_start, layer_end) of
that block (contiguous in the block-major pool, see engine/kv_cache.py). The packed
stream is those regions concatenated in header order; block i of the stream lands in
destination block dest_block_ids[i]. Each region's xxh3_64 travels with it: in the data
chunk that completes it (grpc) or in the report of its landed write (mooncake).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import msgpack
import torch

from splitserve.engine.kv_cache import KVCacheSpec
from splitserve.kvtransfer.config import BACKENDS

WIRE_VERSION = 2  # 2: checksums travel with the blocks (data chunks / written reports), not in the header


class WireError(ValueError):
    """A header or description that cannot be decoded or is inconsistent."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TransferHeader:
    request_id: str
    backend: str
    dest_block_ids: list[int]
    # Chained block hashes (engine/hashing.py) of the leading full blocks; a trailing
    # partial block has none, so this may be one shorter than dest_block_ids.
    block_hashes: list[int]
    layer_start: int
    layer_end: int
    dtype: str
    block_shape: list[int]  # the pool's per-block shape [layers, 2, block_size, kv_heads, head_dim]
    region_nbytes: int  # bytes of one block in the stream (the layer range only)
    receiver_epoch: str  # from Describe; a restarted receiver refuses stale senders
    version: int = WIRE_VERSION

    @property
    def total_nbytes(self) -> int:
        return self.region_nbytes * len(self.dest_block_ids)

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> TransferHeader:
        fields = _unpack_map(raw, "transfer header")
        version = fields.get("version")
        if version != WIRE_VERSION:
            raise WireError(f"transfer header version {version!r} is not supported (this build speaks {WIRE_VERSION})")
        try:
            header = cls(**fields)
        except TypeError as exc:
            raise WireError(f"transfer header has wrong fields: {exc}") from None
        header.check_consistent()
        return header

    def check_consistent(self) -> None:
        """Self-consistency only; matching against a lease and a pool is validate_header's job."""
        if not isinstance(self.request_id, str) or not isinstance(self.receiver_epoch, str):
            raise WireError("transfer header: request_id and receiver_epoch must be strings")
        if self.backend not in BACKENDS:
            raise WireError(f"request {self.request_id!r}: unknown backend {self.backend!r} in the transfer header")
        for name in ("dest_block_ids", "block_hashes", "block_shape"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(type(x) is int for x in value):
                raise WireError(f"request {self.request_id!r}: header field {name} must be a list of integers")
        for name in ("layer_start", "layer_end", "region_nbytes"):
            if type(getattr(self, name)) is not int:
                raise WireError(f"request {self.request_id!r}: header field {name} must be an integer")
        n = len(self.dest_block_ids)
        if n == 0:
            raise WireError(f"request {self.request_id!r}: transfer names no destination blocks")
        if len(self.block_hashes) > n:
            raise WireError(f"request {self.request_id!r}: {len(self.block_hashes)} block hashes for {n} blocks")
        if len(set(self.dest_block_ids)) != n:
            raise WireError(f"request {self.request_id!r}: destination block ids repeat")
        if not 0 <= self.layer_start < self.layer_end:
            raise WireError(f"request {self.request_id!r}: empty layer range [{self.layer_start}, {self.layer_end})")
        if self.region_nbytes <= 0:
            raise WireError(f"request {self.request_id!r}: region_nbytes={self.region_nbytes}")


@dataclass(frozen=True)
class ReceiverInfo:
    """The Describe reply: what a sender must know before pushing to a receiver."""

    epoch: str
    num_blocks: int
    block_shape: list[int]
    dtype: str
    block_nbytes: int
    mooncake_session: str = ""  # "host:rpc_port" when the receiver runs the mooncake backend
    pool_base: int = 0  # registered address of block 0 (mooncake, a one-rank pool; 0 under TP)
    # mooncake: {"segments": [[base, first KV head, number of heads], ...]}, a registered region
    # per rank (kvtransfer/segments.py); in `extra` so that a receiver without it still decodes
    extra: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.block_shape[0]

    @property
    def segments(self) -> list[tuple[int, int, int]]:
        """(base, first KV head, heads) per registered region; a receiver that does not say
        has one: its whole pool at pool_base."""
        listed = self.extra.get("segments")
        if listed is None:
            return [(self.pool_base, 0, self.block_shape[3])]
        if not isinstance(listed, list) or not all(
                isinstance(s, list) and len(s) == 3 and all(type(x) is int for x in s) for s in listed):
            raise WireError(f"receiver description: segments {listed!r} must be a list of [base, first head, heads]")
        return [tuple(s) for s in listed]

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> ReceiverInfo:
        try:
            return cls(**_unpack_map(raw, "receiver description"))
        except TypeError as exc:
            raise WireError(f"receiver description has wrong fields: {exc}") from None


def _unpack_map(raw: bytes, what: str) -> dict:
    try:
        fields = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(fields, dict):
        raise WireError(f"{what} must be a msgpack map, got {type(fields).__name__}")
    return fields


def layer_nbytes(spec: KVCacheSpec) -> int:
    return spec.block_nbytes // spec.num_layers


def check_layout(spec: KVCacheSpec, info: ReceiverInfo, request_id: str) -> None:
    """Sender side: refuse to push into a pool laid out differently from ours."""
    ours = (list(spec.block_shape), dtype_name(spec.dtype))
    theirs = (list(info.block_shape), info.dtype)
    if ours != theirs:
        raise WireError(
            f"request {request_id!r}: sender KV layout {ours} differs from the receiver's {theirs}; "
            "prefill and decode workers must serve the same model with the same block size and dtype")


def validate_header(header: TransferHeader, spec: KVCacheSpec, num_blocks: int, epoch: str) -> str | None:
    """Receiver side: why this header cannot be written into our pool (None if it can)."""
    if header.receiver_epoch != epoch:
        return (f"header was built for receiver epoch {header.receiver_epoch!r} but this receiver is "
                f"{epoch!r} (the decode worker restarted); describe it again")
    if list(header.block_shape) != list(spec.block_shape) or header.dtype != dtype_name(spec.dtype):
        return (f"KV layout {header.block_shape} {header.dtype} does not match this pool's "
                f"{list(spec.block_shape)} {dtype_name(spec.dtype)}")
    if header.layer_end > spec.num_layers:
        return f"layer range [{header.layer_start}, {header.layer_end}) exceeds the pool's {spec.num_layers} layers"
    expected = (header.layer_end - header.layer_start) * layer_nbytes(spec)
    if header.region_nbytes != expected:
        return f"region_nbytes={header.region_nbytes} but layers [{header.layer_start}, {header.layer_end}) hold {expected}"
    bad = [b for b in header.dest_block_ids if not 0 <= b < num_blocks]
    if bad:
        return f"destination blocks {bad[:8]} are outside the pool (0..{num_blocks - 1})"
    return None
