"""store_kv (by slot mapping) and block pack/unpack (Triton) against the references.
These kernels only move bytes, so every comparison here is exact, bit for bit."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference, triton_ops
from tests.kernels.paged_cases import randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_bits_pool(shape, dtype, device, seed=0) -> torch.Tensor:
    """A pool of arbitrary bit patterns, NaN payloads and negative zeros included: a copy
    that goes through float arithmetic would not preserve them all."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (4, 128), (3, 80)])
def test_store_kv_matches_reference(device, dtype, kv_heads, head_dim):
    pool = randn((12, 2, 2, 16, kv_heads, head_dim), dtype, device)
    expected_pool = pool.clone()
    slots = torch.tensor([0, 15, 16, 17, 100, 191, 33], dtype=torch.int32, device=device)
    key = randn((7, kv_heads, head_dim), dtype, device, seed=2)
    value = randn((7, kv_heads, head_dim), dtype, device, seed=3)
    triton_ops.store_kv(key, value, pool[:, 1, 0], pool[:, 1, 1], slots)
    reference.store_kv(key, value, expected_pool[:, 1, 0], expected_pool[:, 1, 1], slots)
    assert same_bytes(pool, expected_pool)  # the other layer untouched, as in the reference


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_store_kv_converts_to_the_cache_dtype_like_torch(device, cache_dtype):
    pool = torch.zeros((4, 1, 2, 16, 2, 64), dtype=cache_dtype, device=device)
    expected_pool = pool.clone()
    key = randn((5, 2, 64), torch.float32, device, seed=4) * 100
    value = randn((5, 2, 64), torch.float32, device, seed=5) * 1e-3
    slots = torch.tensor([3, 4, 20, 40, 63], dtype=torch.int64, device=device)
    triton_ops.store_kv(key, value, pool[:, 0, 0], pool[:, 0, 1], slots)
    reference.store_kv(key, value, expected_pool[:, 0, 0], expected_pool[:, 0, 1], slots)
    assert same_bytes(pool, expected_pool)


def test_store_kv_skips_negative_padding_slots(device):
    pool = torch.zeros((2, 1, 2, 16, 1, 64), dtype=torch.float32, device=device)
    key = torch.ones((3, 1, 64), device=device)
    slots = torch.tensor([-1, 5, -1], dtype=torch.int32, device=device)
    triton_ops.store_kv(key, 2 * key, pool[:, 0, 0], pool[:, 0, 1], slots)
    assert pool.sum().item() == 64 * 3  # only slot 5: K ones, V twos
    assert torch.equal(pool[0, 0, 0, 5], key[1]) and torch.equal(pool[0, 0, 1, 5], 2 * key[1])


def test_store_kv_rejects_mismatched_shapes(device):
    pool = torch.zeros((2, 1, 2, 16, 2, 64), device=device)
    key = torch.zeros((3, 1, 64), device=device)
    with pytest.raises(ValueError, match=r"caches must be \[num_blocks, block_size, 1, 64\]"):
        triton_ops.store_kv(key, key, pool[:, 0, 0], pool[:, 0, 1],
                            torch.zeros(3, dtype=torch.int32, device=device))


@pytest.mark.parametrize("dtype", DTYPES + [torch.uint8], ids=str)
def test_pack_then_unpack_is_byte_exact(device, dtype):
    # 2 layers x K/V x 16 tokens x 2 heads x 64 = 8192 elements per block: two copy chunks
    pool = random_bits_pool((10, 2, 2, 16, 2, 64), dtype, device)
    ids = torch.tensor([7, 2, 9, 0], dtype=torch.int32)  # on the CPU, as a transfer plan has them
    buffer = triton_ops.pack_blocks(pool, ids)
    assert buffer.is_contiguous()
    assert same_bytes(buffer, reference.pack_blocks(pool, ids))

    dest = random_bits_pool((10, 2, 2, 16, 2, 64), dtype, device, seed=1)
    expected = dest.clone()
    dest_ids = torch.tensor([1, 3, 5, 8], dtype=torch.int64)
    triton_ops.unpack_blocks(buffer, dest, dest_ids)
    reference.unpack_blocks(buffer, expected, dest_ids)
    assert same_bytes(dest, expected)
    assert same_bytes(dest[dest_ids.to(device)], pool[ids.long().to(device)])


def test_unpack_accepts_a_flat_buffer(device):
    """The receiving side gets bytes off the wire as one flat tensor."""
    pool = random_bits_pool((6, 1, 2, 16, 1, 64), torch.bfloat16, device)
    flat = triton_ops.pack_blocks(pool, torch.tensor([4, 1])).reshape(-1)
    dest = torch.zeros_like(pool)
    triton_ops.unpack_blocks(flat, dest, torch.tensor([0, 5]))
    assert same_bytes(dest[0], pool[4]) and same_bytes(dest[5], pool[1])
    assert not dest[1:5].view(torch.int16).any()


def test_pack_of_no_blocks(device):
    pool = torch.zeros((3, 1, 2, 16, 1, 64), device=device)
    buffer = triton_ops.pack_blocks(pool, torch.tensor([], dtype=torch.int64))
    assert buffer.shape == (0, 1, 2, 16, 1, 64)
    triton_ops.unpack_blocks(buffer, pool, torch.tensor([], dtype=torch.int64))


def test_pack_and_unpack_reject_bad_ids_and_sizes(device):
    pool = torch.zeros((3, 1, 2, 16, 1, 64), device=device)
    with pytest.raises(IndexError, match=r"block ids must lie in \[0, 3\), got min 0 max 3"):
        triton_ops.pack_blocks(pool, torch.tensor([0, 3]))
    with pytest.raises(IndexError, match="got min -1"):
        triton_ops.unpack_blocks(pool[:1], pool, torch.tensor([-1]))
    with pytest.raises(ValueError, match="buffer has 2048 elements but 2 blocks"):
        triton_ops.unpack_blocks(pool[:1], pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        triton_ops.pack_blocks(pool, torch.tensor([0.0]))
