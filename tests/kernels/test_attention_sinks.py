"""Attention sinks (gpt-oss) in every attention path: one learned logit per query head,
appended to each softmax as a column with no value and dropped after it.

The torch reference against transformers' own gpt-oss eager_attention_forward (float64, over
the same gathered keys), then the native CPU kernels, the prepared CPU decode step and the
Triton kernels (the interpreter here, compiled on a GPU) against the reference: with and
without a sliding window, GQA, an fp8 cache with its scales, several sequences of different
lengths in one batch, prefill over a prefix already in the cache (a chunk), split-K decode
(the sink enters the merge once) and sinks far above and below the scores."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from splitserve.kernels import cpu_native, ops, reference, triton_ops
from splitserve.kernels.cpu_decode_step import PreparedDecodeAttention
from tests.kernels.paged_cases import assert_close, make_paged_kv, randn
from tests.kernels.test_cpu_decode_step import case, general_path

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
WINDOW = 9
# (context lengths, new tokens): a 25-token chunk over a 15-token prefix, a whole prompt, one token
PREFILL = ([40, 17, 5], [25, 17, 1])
DECODE = [1, 9, 10, 33, 70]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the native CPU kernels")


def sinks_for(heads: int, seed: int = 5, spread: float = 2.0) -> torch.Tensor:
    return randn((heads,), torch.float32, CPU, seed=seed) * spread


def transformers_attention(q, k, v, q_pos, scale, window, sinks):
    """transformers' gpt-oss eager attention of queries at q_pos over one sequence's keys (float64)."""
    keys = torch.arange(k.shape[0])[None, :]
    visible = keys <= q_pos[:, None]
    if window:
        visible &= keys > q_pos[:, None] - window
    mask = torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks.double(),
                                   training=False)
    out, _ = eager_attention_forward(module, q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                     v.double().transpose(0, 1)[None], mask[None, None], scale)
    return out[0]  # [queries, heads, dim]


def gathered(cache, table, length):
    return reference._gather_kv(cache, table, length, "test").clone()


def prefill_case(dtype, group, device=CPU, cache_dtype=None):
    seq_lens, new = PREFILL
    kv = make_paged_kv(seq_lens, 2, 32, cache_dtype or dtype, device)
    cu = torch.tensor([0, *new]).cumsum(0).to(torch.int32).to(device)
    q = randn((int(cu[-1]), 2 * group, 32), dtype, device, seed=1)
    return kv, cu, q


def decode_case(dtype, group, device=CPU, cache_dtype=None):
    kv = make_paged_kv(DECODE, 2, 32, cache_dtype or dtype, device, seed=4)
    q = randn((len(DECODE), 2 * group, 32), dtype, device, seed=3)
    return kv, q


@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("spread", [2.0, 40.0])  # 40: sinks far above and below every score
def test_reference_matches_transformers_gpt_oss_attention(window, spread):
    sinks = sinks_for(8, spread=spread)
    kv, cu, q = prefill_case(torch.float32, 4)
    out = reference.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2,
                                            window, 0.0, sinks)
    for b, length in enumerate(PREFILL[0]):
        s, e = int(cu[b]), int(cu[b + 1])
        k, v = gathered(kv.k_cache, kv.block_tables[b], length), gathered(kv.v_cache, kv.block_tables[b], length)
        want = transformers_attention(q[s:e], k, v, torch.arange(length - (e - s), length), 0.2, window, sinks)
        torch.testing.assert_close(out[s:e].double(), want, atol=2e-5, rtol=2e-5)
    kv, q = decode_case(torch.float32, 4)
    out = reference.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, None,
                                           window, 0.0, sinks)
    for b, length in enumerate(DECODE):
        k, v = gathered(kv.k_cache, kv.block_tables[b], length), gathered(kv.v_cache, kv.block_tables[b], length)
        want = transformers_attention(q[b : b + 1], k, v, torch.tensor([length - 1]), 0.2, window, sinks)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=2e-5)


def test_a_sink_is_a_softmax_column_without_a_value():
    """A very negative sink changes nothing; any sink scales the output by 1 - its probability."""
    kv, q = decode_case(torch.float32, 1)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    plain = reference.paged_decode_attention(*args)
    torch.testing.assert_close(reference.paged_decode_attention(*args, sinks=torch.full((2,), -1e4)), plain)
    one = kv.seq_lens == 1  # a lone key: the output is v * e^s / (e^s + e^sink)
    got = reference.paged_decode_attention(*args, sinks=torch.zeros(2))[one]
    score = (q[one] * gathered(kv.k_cache, kv.block_tables[0], 1)).sum(-1) * 0.2
    torch.testing.assert_close(got, plain[one] * torch.sigmoid(score)[..., None])


@native
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("window", [0, WINDOW])
def test_native_kernels_match_the_reference(cache, window):
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    cache_dtype = FP8 if cache == "fp8" else None
    sinks = sinks_for(8)
    kv, cu, q = prefill_case(dtype, 4, cache_dtype=cache_dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2, window, 0.0, sinks)
    torch.testing.assert_close(cpu_native.paged_prefill_attention(*args).float(),
                               reference.paged_prefill_attention(*args).float(), **TOL[dtype])
    kv, q = decode_case(dtype, 4, cache_dtype=cache_dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, None, window, 0.0, sinks)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args).float(),
                               reference.paged_decode_attention(*args).float(), **TOL[dtype])


@native
def test_native_kernels_keep_large_sinks_finite():
    sinks = torch.tensor([200.0, -200.0, 60.0, -60.0])
    kv, cu, q = prefill_case(torch.float32, 2)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2, WINDOW, 0.0, sinks)
    torch.testing.assert_close(cpu_native.paged_prefill_attention(*args), reference.paged_prefill_attention(*args),
                               **TOL[torch.float32])
    kv, q = decode_case(torch.float32, 2)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2, None, 0, 0.0, sinks)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args), reference.paged_decode_attention(*args),
                               **TOL[torch.float32])


def dequantized(kv, k_scale, v_scale):
    """The layer's K and V caches as float values code * scale."""
    pool = kv.pool.float()
    return pool[:, 1, 0] * k_scale, pool[:, 1, 1] * v_scale


@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=native)])
def test_ops_fold_fp8_scales_around_the_sink(backend):
    """k_scale scales the scores, not the sink: ops over fp8 codes with their scales equals the
    reference over a float cache holding code * scale, with the same sinks."""
    sinks = sinks_for(8)
    kv, cu, q = prefill_case(torch.float32, 4, cache_dtype=FP8)
    dkv, dq = decode_case(torch.float32, 4, cache_dtype=FP8)
    scales = dict(k_scale=0.5, v_scale=3.0)
    ops.set_backend(backend)
    try:
        got = ops.paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2,
                                          WINDOW, sinks=sinks, **scales)
        got_decode = ops.paged_decode_attention(dq, dkv.k_cache, dkv.v_cache, dkv.block_tables, dkv.seq_lens, 0.2,
                                                sinks=sinks, **scales)
    finally:
        ops.set_backend(None)
    want = reference.paged_prefill_attention(q, *dequantized(kv, 0.5, 3.0), kv.block_tables, cu, kv.seq_lens, 0.2,
                                             WINDOW, sinks=sinks)
    want_decode = reference.paged_decode_attention(dq, *dequantized(dkv, 0.5, 3.0), dkv.block_tables, dkv.seq_lens,
                                                   0.2, sinks=sinks)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(got_decode, want_decode, **TOL[torch.float32])


def test_bad_sinks_are_refused_in_one_line():
    kv, q = decode_case(torch.float32, 4)
    with pytest.raises(ValueError, match=r"attention sinks must be \[num_heads=8\], got shape \(4,\)"):
        ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2,
                                   sinks=torch.zeros(4))


@native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [None, FP8], ids=["float", "fp8"])
def test_prepared_decode_step_takes_the_layers_sinks(threads, cache_dtype):
    """kernels/cpu_decode_step.py reads attention.sinks; bit for bit the general path with them."""
    layer, qkv, cos, sin, pool, meta = case(window=5, cache_dtype=cache_dtype)
    layer.sinks = sinks_for(layer.num_heads)
    pool2 = pool.clone()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prepared = PreparedDecodeAttention.prepare(layer, qkv, cos, sin, pool[0], pool[1], meta)
        assert prepared is not None
        got = prepared(qkv, cos, sin, meta)
        n = qkv.shape[0]
        q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q = ops.rotary_and_store_kv(q.reshape(n, layer.num_heads, -1), k.reshape(n, layer.num_kv_heads, -1),
                                    v.reshape(n, layer.num_kv_heads, -1), cos, sin, pool2[0], pool2[1],
                                    meta.slot_mapping, layer.k_scale, layer.v_scale)
        want = ops.paged_decode_attention(q, pool2[0], pool2[1], meta.decode_block_tables, meta.decode_seq_lens,
                                          layer.scale, window=layer.window, k_scale=layer.k_scale,
                                          v_scale=layer.v_scale, sinks=layer.sinks).reshape(n, -1)
        plain = general_path(layer, qkv, cos, sin, pool.clone()[0], pool.clone()[1], meta)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, want)
    assert not torch.allclose(got, plain)  # the sinks did change the output


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("window", [0, WINDOW])
def test_triton_prefill_matches_the_reference(device, cache, window):
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    kv, cu, q = prefill_case(dtype, 4, device, FP8 if cache == "fp8" else None)
    sinks = sinks_for(8).to(device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.2, window, 0.0, sinks)
    assert_close(triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args), dtype)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("window", [0, WINDOW])
@pytest.mark.parametrize("num_splits", [1, 3])  # 3: the sink enters the split merge once
def test_triton_decode_matches_the_reference(device, cache, window, num_splits):
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    kv, q = decode_case(dtype, 4, device, FP8 if cache == "fp8" else None)
    sinks = sinks_for(8).to(device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    got = triton_ops.paged_decode_attention(*args, num_splits, window, 0.0, sinks)
    assert_close(got, reference.paged_decode_attention(*args, None, window, 0.0, sinks), dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_decode_with_large_sinks_and_empty_splits(device, num_splits):
    """Sinks far from the scores, and more splits than a 1-token sequence has tokens."""
    kv, q = decode_case(torch.float32, 2, device)
    sinks = torch.tensor([200.0, -200.0, 60.0, -60.0], device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2)
    got = triton_ops.paged_decode_attention(*args, num_splits, 0, 0.0, sinks)
    assert_close(got, reference.paged_decode_attention(*args, None, 0, 0.0, sinks), torch.float32)
