"""Reading block regions out of a KV pool and writing a packed stream into one.

A region is the part of one block a transfer carries: layers [layer_start, layer_end)
of that block, contiguous in the block-major pool. On CPU pools regions are read as
zero-copy memoryviews of the pool and written in place; on CUDA pools they are packed
on the device and copied to the host once (the mooncake backend with RDMA writes GPU
memory directly and does not come through here for the data, only for checksums).
A tensor-parallel engine's pool (ShardedKVPool) is read by gathering every rank's heads
into one buffer and written by scattering each region's heads to the ranks: the bytes on
the wire are those of a one-rank pool whatever the TP size of either side.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from splitserve.engine.kv_cache import KVCachePool
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.kernels import ops

# torch warns that a tensor over gRPC's read-only buffer must not be written; we only
# read from it (it is the source of a copy into the pool).
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


@dataclass(frozen=True)
class RegionLayout:
    block_nbytes: int
    layer_nbytes: int
    layer_start: int
    layer_end: int
    num_layers: int

    @classmethod
    def of(cls, pool: KVCachePool, layer_range: tuple[int, int] | None = None) -> RegionLayout:
        spec = pool.spec
        start, end = layer_range if layer_range is not None else (0, spec.num_layers)
        if not 0 <= start < end <= spec.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is not inside the pool's {spec.num_layers} layers")
        return cls(spec.block_nbytes, spec.block_nbytes // spec.num_layers, start, end, spec.num_layers)

    @property
    def region_nbytes(self) -> int:
        return (self.layer_end - self.layer_start) * self.layer_nbytes

    @property
    def whole_blocks(self) -> bool:
        return self.layer_start == 0 and self.layer_end == self.num_layers

    def offset(self, block_id: int) -> int:
        """Byte offset of a block's region from the start of the pool."""
        return block_id * self.block_nbytes + self.layer_start * self.layer_nbytes


def pool_bytes(pool: KVCachePool) -> torch.Tensor:
    """The whole pool as a flat uint8 tensor (a view, on the pool's device)."""
    return pool.data.view(-1).view(torch.uint8)


def host_regions(pool: KVCachePool, block_ids: Sequence[int], layout: RegionLayout) -> list[memoryview]:
    """One read-only view of host memory per block region, in block_ids order."""
    n = layout.region_nbytes
    if isinstance(pool, ShardedKVPool):  # tensor parallelism: every rank's heads, gathered (one copy)
        flat = memoryview(pool.read_bytes(block_ids, layout.layer_start, layout.layer_end))
        return [flat[i * n:(i + 1) * n] for i in range(len(block_ids))]
    if pool.data.device.type == "cpu":
        flat = memoryview(pool_bytes(pool).numpy())
        return [flat[layout.offset(b):layout.offset(b) + n] for b in block_ids]
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=pool.data.device)
    packed = ops.pack_blocks(pool.data, ids)[:, layout.layer_start:layout.layer_end]
    host = packed.contiguous().cpu().view(-1).view(torch.uint8).numpy()
    flat = memoryview(host)
    return [flat[i * n:(i + 1) * n] for i in range(len(block_ids))]


def split_span(offset: int, length: int, region_nbytes: int) -> list[tuple[int, int, int, int]]:
    """Pieces of stream bytes [offset, offset+length): (region index, offset in region,
    offset in chunk, length). Pure; the receiver's write path is built on it."""
    pieces, pos = [], 0
    while pos < length:
        index, within = divmod(offset + pos, region_nbytes)
        n = min(region_nbytes - within, length - pos)
        pieces.append((index, within, pos, n))
        pos += n
    return pieces


class StreamWriter:
    """Writes one push's packed stream into its destination blocks as chunks arrive,
    hashing each region's bytes on the way in. Chunks must come in stream order."""

    def __init__(self, pool: KVCachePool, dest_block_ids: Sequence[int], layout: RegionLayout):
        self.pool = pool
        self.dest = list(dest_block_ids)
        self.layout = layout
        self.total = layout.region_nbytes * len(self.dest)
        self.received = 0
        self._hashers: dict[int, xxhash.xxh3_64] = {}
        if isinstance(pool, ShardedKVPool):  # a region's heads go to the ranks once it is whole
            self._staged: dict[int, bytearray] = {}
            return
        self._bytes = pool_bytes(pool)
        # On the CPU a chunk's bytes go in by the buffer protocol (a memcpy): a tensor over
        # the received bytes would be a view of a read-only buffer, which torch warns about.
        self._host = memoryview(self._bytes.numpy()) if self._bytes.device.type == "cpu" else None

    def write(self, offset: int, data: memoryview) -> list[tuple[int, int]]:
        """Copy a chunk in place; returns (region index, xxh3) of regions it completed."""
        if offset != self.received:
            raise ValueError(f"chunk at byte {offset} but {self.received} bytes were received so far")
        if offset + len(data) > self.total:
            raise ValueError(f"chunk ends at byte {offset + len(data)}, past the transfer's {self.total} bytes")
        size = self.layout.region_nbytes
        done: list[tuple[int, int]] = []
        whole: list[tuple[int, int]] = []  # (region index, offset in chunk) of complete regions
        for index, within, at, n in split_span(offset, len(data), size):
            piece = data[at:at + n]
            if within == 0 and n == size:
                whole.append((index, at))
                done.append((index, xxhash.xxh3_64_intdigest(piece)))
                continue
            self._copy_part(index, within, piece)
            hasher = self._hashers.setdefault(index, xxhash.xxh3_64())
            hasher.update(piece)
            if within + n == size:
                done.append((index, self._hashers.pop(index).intdigest()))
                if isinstance(self.pool, ShardedKVPool):
                    self._scatter([index], memoryview(self._staged.pop(index)))
        if whole:
            self._write_whole(data, whole)
        self.received += len(data)
        return done

    def _write_whole(self, data: memoryview, whole: list[tuple[int, int]]) -> None:
        size = self.layout.region_nbytes
        contiguous_in_chunk = all(at == whole[0][1] + k * size for k, (_, at) in enumerate(whole))
        if isinstance(self.pool, ShardedKVPool):
            if contiguous_in_chunk:  # one scatter for them all
                start = whole[0][1]
                self._scatter([i for i, _ in whole], data[start:start + size * len(whole)])
            else:
                for index, at in whole:
                    self._scatter([index], data[at:at + size])
            return
        on_device = self.pool.data.device.type != "cpu"
        if on_device and self.layout.whole_blocks and contiguous_in_chunk:
            # Full blocks into a GPU pool: one host-to-device copy, then the unpack kernel
            # scatters them. On CPU a plain memcpy per block is faster than index_copy_.
            start = whole[0][1]
            src = _read_only_tensor(data[start:start + size * len(whole)])
            src = src.to(self.pool.data.device).view(self.pool.data.dtype)
            ids = torch.tensor([self.dest[i] for i, _ in whole], dtype=torch.long)
            ops.unpack_blocks(src, self.pool.data, ids)
            return
        for index, at in whole:
            self._copy(self.layout.offset(self.dest[index]), data[at:at + size])

    def _copy_part(self, index: int, within: int, piece: memoryview) -> None:
        """Part of region `index` from byte `within`: into the pool, or staged (sharded)."""
        if isinstance(self.pool, ShardedKVPool):
            staged = self._staged.setdefault(index, bytearray(self.layout.region_nbytes))
            staged[within:within + len(piece)] = piece
        else:
            self._copy(self.layout.offset(self.dest[index]) + within, piece)

    def _scatter(self, indices: list[int], regions: memoryview) -> None:
        """Whole regions (consecutive in `regions`) into a sharded pool, each rank its heads."""
        spec = self.pool.spec
        shape = (len(indices), self.layout.layer_end - self.layout.layer_start, *spec.block_shape[1:])
        blocks = _read_only_tensor(regions).view(spec.dtype).view(shape)
        self.pool.write([self.dest[i] for i in indices], blocks, self.layout.layer_start)

    def _copy(self, pool_offset: int, piece: memoryview) -> None:
        if self._host is not None:
            self._host[pool_offset:pool_offset + len(piece)] = piece
        else:
            self._bytes[pool_offset:pool_offset + len(piece)].copy_(_read_only_tensor(piece))


def _read_only_tensor(buf: memoryview) -> torch.Tensor:
    """A uint8 tensor over received bytes, no copy. torch warns that the buffer is not
    writable; it is only ever read here (copied to the device)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)
