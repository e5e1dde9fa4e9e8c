"""Paged prefill attention (Triton) against the torch reference: variable-length new
tokens over a cached prefix, causal on the new tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference, triton_ops
from tests.kernels.paged_cases import assert_close, make_paged_kv, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (seq_lens, new tokens per sequence, gqa ratio, kv heads, head_dim).
CASES = [
    # whole prompts of 1/15/16/17 tokens (no prefix)
    ([1, 15, 16, 17], [1, 15, 16, 17], 1, 2, 64),
    # cached prefixes ending inside and on block edges; a sequence with nothing new
    ([17, 33, 16, 5], [1, 16, 15, 0], 4, 2, 128),
    # a 1100-token context with a short new chunk (chunked prefill after a long prefix)
    ([1100, 17], [70, 17], 8, 1, 64),
    ([40, 7], [9, 7], 8, 1, 128),
]


def _run(device, dtype, seq_lens, new_tokens, group, kv_heads, head_dim, seed=0):
    kv = make_paged_kv(seq_lens, kv_heads, head_dim, dtype, device, seed=seed)
    cu = torch.tensor([0, *new_tokens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    q = randn((int(cu[-1]), kv_heads * group, head_dim), dtype, device, seed=seed + 1)
    scale = head_dim ** -0.5
    out = triton_ops.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu,
                                             kv.seq_lens, scale)
    expected = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu,
                                                 kv.seq_lens, scale)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq_lens,new_tokens,group,kv_heads,head_dim", CASES)
def test_prefill_matches_reference(device, dtype, seq_lens, new_tokens, group, kv_heads, head_dim):
    out, expected = _run(device, dtype, seq_lens, new_tokens, group, kv_heads, head_dim)
    assert out.shape == expected.shape
    assert_close(out, expected, dtype)


def test_prefill_long_prompt_without_prefix(device):
    """1030 new tokens: many query tiles, each looping over up to 17 key tiles."""
    out, expected = _run(device, torch.float16, [1030], [1030], 4, 1, 64)
    assert_close(out, expected, torch.float16)


def test_prefill_non_power_of_two_group_and_head_dim(device):
    out, expected = _run(device, torch.float32, [40, 7, 33], [9, 7, 2], 7, 2, 80)
    assert_close(out, expected, torch.float32)


def test_prefill_is_causal_on_new_tokens(device):
    """Changing the last new token's K/V must not change any earlier query's output."""
    kv = make_paged_kv([20], 1, 64, torch.float32, device)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
    q = randn((8, 2, 64), torch.float32, device)
    before = triton_ops.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.1)
    last_block = int(kv.block_tables[0, 1])
    kv.k_cache[last_block, 3] += 5.0  # position 19: the last new token
    kv.v_cache[last_block, 3] -= 5.0
    after = triton_ops.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.1)
    torch.testing.assert_close(after[:7], before[:7], atol=0, rtol=0)
    assert not torch.allclose(after[7], before[7])


def test_prefill_rejects_bad_cu_seqlens(device):
    kv = make_paged_kv([5, 9], 1, 64, torch.float32, device)
    q = randn((14, 2, 64), torch.float32, device)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be int32 \[batch\+1=3\]"):
        triton_ops.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                           torch.tensor([0, 14], dtype=torch.int32, device=device),
                                           kv.seq_lens, 0.1)
