"""Test-case builders for the paged-attention kernels: a block-major KV pool shaped like
the engine's (splitserve/engine/kv_cache.py), its per-layer strided K/V views, and
shuffled block tables, so kernels never see the contiguous layout they might assume."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Largest |kernel - reference| allowed, per dtype (as atol and rtol). float32 differs only
# by summation order (observed <= 6e-7). float16/bfloat16 round the softmax weights to the
# cache dtype before P @ V, as flash-attention kernels do, and both sides round the output:
# observed up to 2 units in the last place of outputs of magnitude 1-2 (float16 2e-3,
# bfloat16 1.6e-2); the bounds leave about 2x margin.
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


@dataclass
class PagedKV:
    pool: torch.Tensor  # [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    k_cache: torch.Tensor  # strided view of one layer
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    block_size: int = 16,
    num_layers: int = 2,
    layer: int = 1,
    first_block_id: int = 0,
    seed: int = 0,
) -> PagedKV:
    """Random K/V for sequences of the given lengths in shuffled blocks of a pool whose
    ids start at `first_block_id`. Only the blocks in use are written, so a pool with
    huge ids is mostly untouched virtual memory."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    used = sum(per_seq)
    spare = 3
    num_blocks = first_block_id + used + spare
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    pool = torch.empty(shape, dtype=dtype, device=device)
    ids = first_block_id + torch.randperm(used + spare, generator=gen)[:used]
    block_shape = (used, *shape[1:])
    pool[ids.to(device)] = torch.randn(block_shape, generator=gen).to(dtype).to(device)
    width = max(per_seq) if per_seq else 0
    table = torch.empty((len(seq_lens), width), dtype=torch.int32)
    start = 0
    for row, n in enumerate(per_seq):
        mine = ids[start:start + n]
        start += n
        pad = mine[:1] if n else ids[:1]  # padding must still be a valid id
        table[row] = torch.cat([mine, pad.repeat(width - n)]) if width else table[row]
    return PagedKV(
        pool=pool,
        k_cache=pool[:, layer, 0],
        v_cache=pool[:, layer, 1],
        block_tables=table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def randn(shape, dtype: torch.dtype, device: torch.device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])
