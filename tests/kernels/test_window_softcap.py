"""Sliding-window attention and logit soft-capping in both paged-attention kernels: the
torch reference against a dense, unpaged definition (transformers' semantics: a query at
position p sees keys p - window + 1 .. p), and Triton against the reference, with lengths
around the window edge and GQA groups 1/4/8."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference, triton_ops
from tests.kernels.paged_cases import assert_close, make_paged_kv, randn

WINDOW = 32
# (context lengths, new tokens per sequence): shorter than, at, just past and far past the window
PREFILL = ([31, 32, 33, 100], [31, 5, 33, 70])
DECODE = [1, 31, 32, 33, 64, 100]
# GQA groups: 1 and 8 (the ends: one query head per KV head, eight sharing one) in `make test`;
# 4 takes no path of its own through either kernel, so it is in the full sweep (`make test-full`).
GROUPS = [1, pytest.param(4, marks=pytest.mark.full), 8]


def dense(q, k, v, q_pos, scale, window, softcap):
    """Plain attention of queries at `q_pos` over keys 0..L-1 of one sequence (float64)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(k.shape[0])[None, :]
    visible = keys <= q_pos[:, None]
    if window:
        visible &= keys > q_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def gathered(cache, table, length):
    return reference._gather_kv(cache, table, length, "test").clone()


@pytest.mark.parametrize("window,softcap", [(WINDOW, 0.0), (0, 5.0), (WINDOW, 5.0)])
def test_reference_matches_the_dense_definition(window, softcap):
    seq_lens, new = PREFILL
    kv = make_paged_kv(seq_lens, 2, 32, torch.float32, torch.device("cpu"))
    cu = torch.tensor([0, *new]).cumsum(0).to(torch.int32)
    q = randn((int(cu[-1]), 8, 32), torch.float32, torch.device("cpu"))
    out = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2,
                                            window, softcap)
    for b, length in enumerate(seq_lens):
        s, e = int(cu[b]), int(cu[b + 1])
        k, v = gathered(kv.k_cache, kv.block_tables[b], length), gathered(kv.v_cache, kv.block_tables[b], length)
        want = dense(q[s:e], k, v, torch.arange(length - (e - s), length), 0.2, window, softcap)
        torch.testing.assert_close(out[s:e].double(), want, atol=2e-5, rtol=2e-5)
    dq = randn((len(DECODE), 8, 32), torch.float32, torch.device("cpu"), seed=3)
    dkv = make_paged_kv(DECODE, 2, 32, torch.float32, torch.device("cpu"), seed=4)
    out = reference.paged_decode_attention(dq, dkv.k_cache, dkv.v_cache, dkv.block_tables, dkv.seq_lens, 0.2,
                                           None, window, softcap)
    for b, length in enumerate(DECODE):
        k, v = gathered(dkv.k_cache, dkv.block_tables[b], length), gathered(dkv.v_cache, dkv.block_tables[b], length)
        want = dense(dq[b : b + 1], k, v, torch.tensor([length - 1]), 0.2, window, softcap)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=2e-5)


def test_a_window_wider_than_the_context_changes_nothing():
    kv = make_paged_kv(DECODE, 1, 32, torch.float32, torch.device("cpu"))
    q = randn((len(DECODE), 4, 32), torch.float32, torch.device("cpu"))
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, None)
    torch.testing.assert_close(reference.paged_decode_attention(*args, 101),
                               reference.paged_decode_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("window,softcap", [(WINDOW, 0.0), (0, 5.0), (WINDOW, 5.0)])
def test_triton_prefill_matches_reference(device, dtype, group, window, softcap):
    seq_lens, new = PREFILL
    kv = make_paged_kv(seq_lens, 2, 64, dtype, device)
    cu = torch.tensor([0, *new]).cumsum(0).to(torch.int32).to(device)
    q = randn((int(cu[-1]), 2 * group, 64), dtype, device, seed=1)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125, window, softcap)
    assert_close(triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,softcap", [(WINDOW, 0.0), (0, 5.0), (WINDOW, 5.0)])
def test_triton_decode_matches_reference(device, dtype, group, num_splits, window, softcap):
    kv = make_paged_kv(DECODE, 2, 64, dtype, device)
    q = randn((len(DECODE), 2 * group, 64), dtype, device, seed=2)
    out = triton_ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125,
                                            num_splits, window, softcap)
    expected = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125,
                                                None, window, softcap)
    assert_close(out, expected, dtype)
