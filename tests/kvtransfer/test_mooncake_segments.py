"""Mooncake under tensor parallelism (kvtransfer/segments.py): each rank's pool shard is a
registered segment, and a push writes every block's KV heads one-sided into each receiver
rank's shard, over Mooncake's tcp transport. Equal head ranges go shard to shard with no
copy; other TP sizes (1 -> 2, 2 -> 1, 4 -> 2, a replicated KV head) through a staged gather,
as the grpc backend re-shards them. The receiver ends up with the bytes grpc would give it:
the source's blocks, every head, in the destination blocks (layer ranges too)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.kvtransfer import KVReceiver, create_sender
from splitserve.kvtransfer.pool_io import RegionLayout, host_regions
from splitserve.kvtransfer.segments import Segment, check_segments, plan, pool_segments
from tests.kvtransfer.conftest import config_for

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype=torch.bfloat16)
BLOCKS = 10
SPLIT = {1: [(0, 4)], 2: [(0, 2), (2, 2)], 4: [(0, 1), (1, 1), (2, 1), (3, 1)]}


def pool_of(ranges: list[tuple[int, int]], full: torch.Tensor, spec: KVCacheSpec = SPEC):
    """A one-rank KVCachePool (one range of every head) or a ShardedKVPool of `full`'s heads."""
    if ranges == [(0, spec.num_kv_heads)]:
        pool = KVCachePool(spec, BLOCKS)
        pool.data.copy_(full)
        return pool
    return ShardedKVPool(spec, BLOCKS, [full[..., f:f + n, :].clone() for f, n in ranges], ranges)


def every_head(pool) -> torch.Tensor:
    return pool.read(range(BLOCKS)) if isinstance(pool, ShardedKVPool) else pool.data.clone()


@pytest.mark.parametrize("src_ranges,dest_ranges", [
    (SPLIT[2], SPLIT[2]), (SPLIT[1], SPLIT[2]), (SPLIT[2], SPLIT[1]), (SPLIT[4], SPLIT[2]), (SPLIT[1], SPLIT[1]),
    ([(0, 1), (0, 1)], [(0, 1), (0, 1)]),  # one KV head, replicated on both ranks (both sides)
    ([(0, 1)], [(0, 1), (0, 1)]),
], ids=["2-2", "1-2", "2-1", "4-2", "1-1", "replicated-2-2", "replicated-1-2"])
def test_a_push_lands_every_ranks_heads_in_its_shard(src_ranges, dest_ranges):
    heads = max(f + n for f, n in src_ranges)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=heads, head_dim=8, block_size=4, dtype=torch.bfloat16)
    torch.manual_seed(0)
    src_full = torch.randn(BLOCKS, *spec.block_shape).to(spec.dtype)
    src = pool_of(src_ranges, src_full, spec)
    dest = pool_of(dest_ranges, torch.zeros(BLOCKS, *spec.block_shape, dtype=spec.dtype), spec)
    receiver = KVReceiver(dest, config_for("mooncake"), worker_id="segments")
    receiver.start()
    sender = create_sender("mooncake", config_for("mooncake"))
    try:
        for rid, src_ids, dest_ids, layer_ranges in [("whole", [1, 2, 3, 7], [5, 6, 7, 0], [None]),
                                                     ("by-layers", [4, 8], [2, 9], [(1, 3), (0, 1)])]:
            done = receiver.expect(rid, dest_ids, [], lambda ids: None)
            for layers in layer_ranges:
                sender.push(rid, receiver.address, src, src_ids, dest_ids, [], layer_range=layers)
            assert done.result(timeout=30).ok
    finally:
        sender.close()
        receiver.stop()
    want = torch.zeros(BLOCKS, *spec.block_shape, dtype=spec.dtype)
    want[[5, 6, 7, 0]] = src_full[[1, 2, 3, 7]]
    want[[2, 9]] = src_full[[4, 8]]
    assert torch.equal(every_head(dest), want)
    if isinstance(dest, ShardedKVPool):  # each rank's shard holds its heads (replicas too)
        for shard, (f, n) in zip(dest.shards, dest_ranges, strict=True):
            assert torch.equal(shard, want[..., f:f + n, :])


def test_equal_head_ranges_write_shard_to_shard_and_others_are_staged():
    full = torch.zeros(BLOCKS, *SPEC.block_shape, dtype=SPEC.dtype)
    two = pool_of(SPLIT[2], full)
    layout = RegionLayout.of(two)
    regions = host_regions(two, [0, 1, 2], layout)
    dest = [Segment(1 << 40, 0, 2), Segment(1 << 41, 2, 2)]
    direct = plan(pool_segments(two), dest, SPEC, layout, [0, 1, 2], [4, 5, 6], regions)
    half = SPEC.block_nbytes // 2  # a block in a 2-head shard
    assert direct.staged == [] and direct.parts == 2
    assert [(w.src, w.dst, w.length, w.first, w.count) for w in direct.writes] == [  # 3 adjacent blocks: one write
        (two.shards[0].data_ptr(), (1 << 40) + 4 * half, 3 * half, 0, 3),
        (two.shards[1].data_ptr(), (1 << 41) + 4 * half, 3 * half, 0, 3)]
    one = plan(pool_segments(two), [Segment(1 << 40, 0, 4)], SPEC, layout, [0, 1, 2], [4, 5, 6], regions)
    assert len(one.staged) == 1 and one.writes[0].src == one.staged[0].data_ptr() and one.parts == 1


def test_a_receiver_whose_segments_miss_heads_is_refused():
    assert check_segments([Segment(4096, 0, 2), Segment(8192, 2, 2)], 4) is None
    assert check_segments([Segment(4096, 0, 2)], 4) == "its segments hold KV heads [0, 1], not all 4"
    assert check_segments([Segment(4096, 3, 2)], 4) == "segment [4096, 3, 2] is not a registered range of the pool's 4 KV heads"
