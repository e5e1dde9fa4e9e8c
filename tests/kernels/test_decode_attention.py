"""Split-KV paged decode attention (Triton) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference, triton_ops
from splitserve.kernels.triton_decode_attention import MAX_SPLITS, choose_num_splits
from tests.kernels.paged_cases import assert_close, make_paged_kv, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (seq_lens, gqa ratio, kv heads, head_dim, num_splits). Lengths 1/15/16/17 sit around
# the 16-token block edge; 1100 spans 69 blocks; 8 or 16 splits over 1-2 blocks leave
# most splits empty ("more splits than blocks").
CASES = [
    ([1, 15, 16, 17], 1, 2, 64, None),
    ([1, 15, 16, 17], 4, 2, 128, 1),
    ([1, 15, 16, 17], 8, 1, 64, 8),
    ([17], 1, 1, 128, 16),
    ([1100, 17], 4, 1, 128, None),
    ([1100], 8, 1, 64, 3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seq_lens,group,kv_heads,head_dim,num_splits", CASES)
def test_decode_matches_reference(device, dtype, seq_lens, group, kv_heads, head_dim, num_splits):
    kv = make_paged_kv(seq_lens, kv_heads, head_dim, dtype, device)
    q = randn((len(seq_lens), kv_heads * group, head_dim), dtype, device)
    scale = head_dim ** -0.5
    out = triton_ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens,
                                            scale, num_splits)
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                                kv.seq_lens, scale)
    assert out.shape == q.shape
    assert_close(out, expected, dtype)


def test_decode_split_count_does_not_change_the_result(device):
    """1 split writes the output directly; more go through the log-sum-exp merge."""
    kv = make_paged_kv([300, 40], 2, 64, torch.float32, device)
    q = randn((2, 8, 64), torch.float32, device)
    outs = [triton_ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables,
                                              kv.seq_lens, 0.125, n) for n in (1, 2, 5, 40)]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=2e-6, rtol=2e-6)


def test_decode_non_power_of_two_group_and_head_dim(device):
    """Qwen2-0.5B has 14 heads over 2 KV heads (group 7); some models use head_dim 80."""
    kv = make_paged_kv([33, 5], 2, 80, torch.float32, device)
    q = randn((2, 14, 80), torch.float32, device)
    out = triton_ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1, 2)
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.1)
    assert_close(out, expected, torch.float32)


def test_decode_reads_a_strided_query(device):
    """q sliced out of a fused qkv projection is not contiguous."""
    kv = make_paged_kv([20], 1, 64, torch.float32, device)
    qkv = randn((1, 6, 64), torch.float32, device)
    q = qkv[:, :4]
    out = triton_ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = reference.paged_decode_attention(q.contiguous(), kv.k_cache, kv.v_cache, kv.block_tables,
                                                kv.seq_lens, 0.125)
    assert_close(out, expected, torch.float32)


def test_choose_num_splits():
    # batch 1 on a 132-SM H100 with 8 KV heads: two waves want 33 programs a head, one 64-token tile each at least
    assert choose_num_splits(1, 8, 2048, 132) == 32  # one 64-token tile per split, 33 wanted
    assert choose_num_splits(1, 8, 1040, 132) == 17
    assert choose_num_splits(1, 8, 60, 132) == 1  # too short to split
    assert choose_num_splits(256, 8, 4096, 132) == 1  # the batch alone fills the GPU
    assert choose_num_splits(1, 1, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(0, 8, 0, 132) == 1


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(q=a["q"][:, :3]), "not a multiple of num_kv_heads"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables must be int32"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens must be [batch=2]"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :8]), "k_cache and v_cache"),
        (lambda a: a.update(q=a["q"].half()), "must share a dtype"),
        (lambda a: a.update(num_splits=0), "num_splits must be a positive int"),
    ],
)
def test_decode_rejects_bad_input_with_a_clear_error(device, mutate, message):
    kv = make_paged_kv([5, 9], 2, 64, torch.float32, device)
    args = {"q": randn((2, 4, 64), torch.float32, device), "k_cache": kv.k_cache, "v_cache": kv.v_cache,
            "block_tables": kv.block_tables, "seq_lens": kv.seq_lens, "scale": 0.1, "num_splits": None}
    mutate(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        triton_ops.paged_decode_attention(**args)
