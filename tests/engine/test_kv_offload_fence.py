"""The write-down fence (engine/kv_offload/offloader.py): a block the background writer has
not copied yet may be reused on the device at any moment; whatever the timing, a tier never
holds other bytes under a hash than the block had when it went idle."""

import torch

from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.engine.kv_offload.offloader import KVOffloader

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)


def test_a_block_reused_right_after_going_idle_is_written_down_with_its_idle_bytes():
    pool = KVCachePool(SPEC, 8)
    off = KVOffloader(pool, host_bytes=512 * SPEC.block_nbytes)
    try:
        for i in range(300):  # races the writer: sometimes it copied already, sometimes the fence does
            b = i % 4
            pool.block(b).fill_(float(i))
            off.on_cached_free(b, 1000 + i)
            off.before_reuse(b)  # the engine hands the block out now...
            pool.block(b).fill_(-1.0)  # ...and the next step overwrites it
        assert off.wait_idle()
        c = off.stats().counters
        assert c.dropped_blocks == 0 and c.stored_blocks["host"] == 300
        for i in range(300):
            assert off.load(1000 + i, 7)
            assert torch.equal(pool.block(7), torch.full_like(pool.block(7), float(i))), i
    finally:
        off.close()


def test_with_no_free_host_slot_the_engine_thread_drops_the_write_instead_of_waiting():
    pool = KVCachePool(SPEC, 8)
    off = KVOffloader(pool, host_bytes=1 * SPEC.block_nbytes)
    try:
        with off.lock:  # block 1 noted, not yet copied (no queue item: the writer never takes it)
            off.pending[1] = 99
            off.host.take_slot()  # and the one slot is taken (as mid-write)
        off.before_reuse(1)
        assert off.stats().counters.dropped_blocks == 1 and not off.pending
        assert not off.load(99, 2)
    finally:
        off.close()
