"""Block ids above 32767 in a pool whose per-layer block stride is 65536 elements, so
block_id * stride passes 2**31: any int32 offset arithmetic in a kernel wraps and reads
or writes the wrong memory. The pool is ~4.3 GB of *virtual* memory (torch.empty); only
the few blocks a test uses are ever touched, so its resident size stays small."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference, triton_ops
from tests.kernels.paged_cases import assert_close, make_paged_kv, randn

FIRST_ID = 32768
# 8 layers x K/V x 16 tokens x 4 kv heads x 64 = 65536 elements per block
SHAPE = {"num_kv_heads": 4, "head_dim": 64, "num_layers": 8, "layer": 7}


@pytest.fixture
def big(device):
    kv = make_paged_kv([40, 17], SHAPE["num_kv_heads"], SHAPE["head_dim"], torch.float16, device,
                       num_layers=SHAPE["num_layers"], layer=SHAPE["layer"], first_block_id=FIRST_ID)
    assert kv.k_cache.stride(0) == 65536
    assert int(kv.block_tables.min()) >= FIRST_ID
    assert int(kv.block_tables.max()) * kv.k_cache.stride(0) >= 2**31
    return kv


def test_decode_with_block_ids_above_32767(big, device):
    q = randn((2, 16, 64), torch.float16, device)
    for num_splits in (1, 3):
        out = triton_ops.paged_decode_attention(q, big.k_cache, big.v_cache, big.block_tables,
                                                big.seq_lens, 0.125, num_splits)
        expected = reference.paged_decode_attention(q, big.k_cache, big.v_cache, big.block_tables,
                                                    big.seq_lens, 0.125)
        assert_close(out, expected, torch.float16)


def test_prefill_with_block_ids_above_32767(big, device):
    cu = torch.tensor([0, 10, 27], dtype=torch.int32, device=device)
    q = randn((27, 8, 64), torch.float16, device)
    out = triton_ops.paged_prefill_attention(q, big.k_cache, big.v_cache, big.block_tables, cu,
                                             big.seq_lens, 0.125)
    expected = reference.paged_prefill_attention(q, big.k_cache, big.v_cache, big.block_tables, cu,
                                                 big.seq_lens, 0.125)
    assert_close(out, expected, torch.float16)


def test_store_kv_with_block_ids_above_32767(big, device):
    block = int(big.block_tables[0, 1])
    slots = torch.tensor([block * 16 + 3, block * 16 + 15], dtype=torch.int64, device=device)
    key = randn((2, 4, 64), torch.float16, device, seed=7)
    value = randn((2, 4, 64), torch.float16, device, seed=8)
    triton_ops.store_kv(key, value, big.k_cache, big.v_cache, slots)
    assert torch.equal(big.k_cache[block, 3], key[0]) and torch.equal(big.k_cache[block, 15], key[1])
    assert torch.equal(big.v_cache[block, 3], value[0]) and torch.equal(big.v_cache[block, 15], value[1])


def test_pack_unpack_with_block_ids_above_32767(big, device):
    ids = big.block_tables[0, :2].cpu()
    buffer = triton_ops.pack_blocks(big.pool, ids)
    assert torch.equal(buffer.view(torch.int16), reference.pack_blocks(big.pool, ids).view(torch.int16))
    dest = big.block_tables[1, :1].cpu()  # overwrite the other sequence's block with the first
    triton_ops.unpack_blocks(buffer[:1], big.pool, dest)
    assert torch.equal(big.pool[int(dest[0])].view(torch.int16), buffer[0].view(torch.int16))
