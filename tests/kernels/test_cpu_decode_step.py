"""The prepared CPU decode attention (kernels/cpu_decode_step.py) against the general path it
replaces (ops.rotary_and_store_kv, then ops.paged_decode_attention), bit for bit: the attention
output and every byte of both caches, for float32 and bfloat16, partial rotary, GQA, sliding
windows and soft-caps, an fp8 cache with its scales, one thread and two. Where the kernels
would not take the tensors, prepare() says None; a step laid out otherwise fails fits(); a bad
slot is refused before anything is written; and a served model's decode steps take the path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.models.layers import AttentionMetadata
from splitserve.kernels import ops
from splitserve.kernels.cpu_decode_step import PreparedDecodeAttention

BLOCK = 4


def gen(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def case(dtype=torch.float32, heads=9, kv_heads=3, dim=64, rot=64, window=0, softcap=0.0, cache_dtype=None,
         lens=(7, 1, 13, 30)):
    """A decode step of len(lens) sequences over a pool holding their earlier tokens."""
    n, blocks = len(lens), 40
    layer = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, q_size=heads * dim,
                            kv_size=kv_heads * dim, scale=dim ** -0.5, window=window, softcap=softcap,
                            k_scale=0.5 if cache_dtype else 1.0, v_scale=2.0 if cache_dtype else 1.0)
    qkv = gen(n, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = gen(n, rot // 2, seed=1)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    pool = gen(2, blocks, BLOCK, kv_heads, dim, seed=2).to(cache_dtype or dtype)
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(3))[:n * 8].reshape(n, 8)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    slots = torch.stack([tables[i, (length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK
                         for i, length in enumerate(lens)]).to(torch.int64)
    meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0, prefill_block_tables=None,
                             prefill_cu_seqlens_q=None, prefill_seq_lens=None,
                             decode_block_tables=tables.to(torch.int32), decode_seq_lens=lens_t)
    return layer, qkv, cos, sin, pool, meta


def general_path(layer, qkv, cos, sin, k_cache, v_cache, meta):
    n = qkv.shape[0]
    q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    q = q.reshape(n, layer.num_heads, layer.head_dim)
    k, v = k.reshape(n, layer.num_kv_heads, layer.head_dim), v.view(n, layer.num_kv_heads, layer.head_dim)
    q = ops.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale)
    out = ops.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                     layer.scale, window=layer.window, softcap=layer.softcap,
                                     k_scale=layer.k_scale, v_scale=layer.v_scale)
    return out.reshape(n, layer.q_size)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kwargs", [
    dict(),  # SmolLM2's geometry
    dict(dtype=torch.bfloat16),
    dict(heads=8, kv_heads=2, dim=128, rot=64),  # partial rotary (Phi-4-mini)
    dict(heads=4, kv_heads=4, dim=32, rot=32, window=5, softcap=30.0),  # Gemma-like window and soft-cap
    dict(cache_dtype=torch.float8_e4m3fn),  # fp8 KV cache with its scales
])
def test_the_prepared_path_gives_the_general_paths_bits(kwargs, threads, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer, qkv, cos, sin, pool, meta = case(**kwargs)
        want_pool, got_pool = pool.clone(), pool.clone()
        want = general_path(layer, qkv, cos, sin, want_pool[0], want_pool[1], meta)
        prepared = PreparedDecodeAttention.prepare(layer, qkv, cos, sin, got_pool[0], got_pool[1], meta)
        assert prepared is not None
        got = prepared(qkv, cos, sin, meta)
    finally:
        torch.set_num_threads(saved)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(got_pool.view(torch.uint8), want_pool.view(torch.uint8))  # both caches, every byte
    assert not torch.equal(got_pool.view(torch.uint8), pool.view(torch.uint8))  # the new K/V rows were written


def test_prepare_declines_what_the_native_kernels_would_not_take(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    layer, qkv, cos, sin, pool, meta = case()
    assert PreparedDecodeAttention.prepare(layer, qkv, cos, sin, pool[0], pool[1], meta) is not None
    half = case(dtype=torch.float16)
    assert PreparedDecodeAttention.prepare(half[0], half[1], half[2], half[3], half[4][0], half[4][1], half[5]) is None
    wide = torch.cat([qkv, qkv], dim=1)[:, :qkv.shape[1]]  # rows not contiguous
    assert PreparedDecodeAttention.prepare(layer, wide, cos, sin, pool[0], pool[1], meta) is None
    assert PreparedDecodeAttention.prepare(layer, qkv, cos, sin, pool[0], pool[1].to(torch.bfloat16), meta) is None
    monkeypatch.setenv("SPLITSERVE_KERNELS", "reference")
    assert PreparedDecodeAttention.prepare(layer, qkv, cos, sin, pool[0], pool[1], meta) is None


def test_a_step_laid_out_otherwise_does_not_fit():
    layer, qkv, cos, sin, pool, meta = case()
    prepared = PreparedDecodeAttention.prepare(layer, qkv, cos, sin, pool[0], pool[1], meta)
    assert prepared.fits(qkv, cos, sin, pool[0], meta)
    other_pool = pool.clone()
    assert not prepared.fits(qkv, cos, sin, other_pool[0], meta)  # the pool moved
    assert not prepared.fits(qkv.to(torch.bfloat16), cos, sin, pool[0], meta)
    meta64 = AttentionMetadata(**{**meta.__dict__, "decode_block_tables": meta.decode_block_tables.long()})
    assert not prepared.fits(qkv, cos, sin, pool[0], meta64)
    assert not prepared.fits(qkv[:2], cos[:2], sin[:2], pool[0], meta)  # rows and sequences disagree


@pytest.mark.parametrize("bad_slot", [-1, 40 * BLOCK])
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(bad_slot):
    layer, qkv, cos, sin, pool, meta = case()
    prepared = PreparedDecodeAttention.prepare(layer, qkv, cos, sin, pool[0], pool[1], meta)
    meta.slot_mapping[2] = bad_slot
    before = pool.clone()
    with pytest.raises(ValueError, match="outside the KV pool"):
        prepared(qkv, cos, sin, meta)
    assert torch.equal(pool, before)


def test_a_served_models_decode_steps_take_the_prepared_path(make_ckpt, monkeypatch):
    """Every layer of every pure-decode step goes through it, and the tokens are those of the
    reference kernels."""
    from splitserve.engine import LLM, SamplingParams

    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    calls = []
    original = PreparedDecodeAttention.__call__
    monkeypatch.setattr(PreparedDecodeAttention, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    llm = LLM(str(make_ckpt("llama")), num_kv_blocks=64)
    layers = llm.engine.model_config.num_layers
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 2, 7, 11, 3], [8, 1, 4]]
    fast = [o.token_ids for o in llm.generate(prompts, params)]
    assert len(calls) == 5 * layers  # 6 tokens: the first from the prefill, then 5 decode steps of both
    monkeypatch.setenv("SPLITSERVE_KERNELS", "reference")
    assert [o.token_ids for o in llm.generate(prompts, params)] == fast
    assert len(calls) == 5 * layers  # the reference backend never prepares
