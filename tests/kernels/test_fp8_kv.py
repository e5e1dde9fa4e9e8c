"""FP8 (float8_e4m3fn) KV cache in every kernel: the KV write bit-equal to torch's
`x.div(scale).to(torch.float8_e4m3fn)` (which saturates at +-448 on CPU, as vLLM's write
does), and the native CPU and Triton attention kernels over an fp8 cache against the torch
reference over the same cache. The dequantised values are exact (every e4m3 value is a
float32 and a bfloat16), so the tolerance is float accumulation order only."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import cpu_fused, cpu_native, ops, reference, triton_ops
from tests.kernels.paged_cases import make_paged_kv, randn

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the native CPU kernels")


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Values that exercise the cast: every bfloat16 bit pattern (so every rounding tie,
    subnormal and overflow e4m3 has), then float32s off the bfloat16 grid."""
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    if dtype == torch.bfloat16:
        return bf16
    gen = torch.Generator().manual_seed(0)
    around = bf16.float() * (1 + torch.rand(bf16.shape, generator=gen) * 2**-6)  # between bf16 neighbours
    exact = torch.tensor([448.0, 464.0, 463.99, 480.0, -465.0, 2**-9, 2**-10, 3 * 2**-11, 2**-6 * 0.999,
                          float("inf"), float("-inf"), float("nan")])
    return torch.cat([bf16.float(), around, exact])


def same_codes(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal e4m3 codes, except that a NaN may carry either sign: torch's own bfloat16 ops
    give NaNs of either sign depending on whether the vectorised loop handled the element."""
    nan = want.float().isnan()
    got_bits, want_bits = got.view(torch.uint8), want.view(torch.uint8)
    return bool(torch.equal(got_bits[~nan], want_bits[~nan]) and got.float()[nan].isnan().all())


def as_rows(values: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    pad = (-values.numel()) % (heads * dim)
    return torch.cat([values, values[:pad]]).view(-1, heads, dim)


def write_rows(key, value, k_scale, v_scale, backend, cos=None, sin=None):
    """Rows stored through ops.rotary_and_store_kv (rotation cos/sin; default none: cos 1,
    sin 0) into an fp8 pool, one token a slot; returns the (k, v) codes in slot order."""
    n, heads, dim = key.shape
    k_cache = torch.zeros((n, 1, heads, dim), dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    if cos is None:
        cos, sin = torch.ones(n, dim, dtype=key.dtype), torch.zeros(n, dim, dtype=key.dtype)
    q = torch.zeros((n, heads, dim), dtype=key.dtype)
    ops.set_backend(backend)
    try:
        ops.rotary_and_store_kv(q, key, value, cos, sin, k_cache, v_cache, torch.arange(n), k_scale, v_scale)
    finally:
        ops.set_backend(None)
    return k_cache.view(n, heads, dim), v_cache.view(n, heads, dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["reference", pytest.param("native", marks=native)])
def test_the_kv_write_is_bit_equal_to_torchs_cast(dtype, backend):
    """V is written as it comes (K is rotated first: the next test)."""
    values = as_rows(every_value(dtype), 4, 64)
    for scale in (1.0, 0.37, 2.5):
        _, codes = write_rows(torch.zeros_like(values), values, 1.0, scale, backend)
        want = values.div(scale).to(FP8)
        assert same_codes(codes, want), (backend, scale)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_native_rotary_kv_write_is_bit_equal_to_the_reference(dtype):
    values = as_rows(every_value(dtype), 4, 64)
    values = values[~values.isnan().any(-1).any(-1)]  # NaN rows: the rotation spreads them
    gen = torch.Generator().manual_seed(3)
    angles = torch.rand(values.shape[0], 32, generator=gen) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    for k_scale in (1.0, 0.37):
        got, _ = write_rows(values, values, k_scale, 1.0, "native", cos, sin)
        want, _ = write_rows(values, values, k_scale, 1.0, "reference", cos, sin)
        assert same_codes(got, want), k_scale


def test_the_write_saturates_at_448_and_rounds_to_nearest_even():
    x = torch.tensor([[[500.0, -1e6, float("inf"), 464.0, 17.0, 19.0, 2**-10, 3 * 2**-10]]])
    _, v = write_rows(x, x, 1.0, 1.0, "reference")
    assert v.float().flatten().tolist() == [448.0, -448.0, 448.0, 448.0, 16.0, 20.0, 0.0, 2**-9 * 2]


def single_key_pool(codes: torch.Tensor, dim: int):
    """One sequence of one token per code row: attention over one key returns its V row."""
    n = codes.shape[0]
    cache = codes.view(n, 1, 1, dim)
    return cache, torch.arange(n, dtype=torch.int32)[:, None], torch.ones(n, dtype=torch.int32)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_decode_reads_every_code_exactly(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8)  # the two NaNs left out
    rows = torch.cat([codes, codes[:2]]).view(-1, 32)  # 256 values in 8 rows of 32
    cache, tables, lens = single_key_pool(rows, 32)
    q = torch.ones((rows.shape[0], 1, 32), dtype=dtype)
    out = cpu_native.paged_decode_attention(q, cache, cache, tables, lens, 1.0)
    assert torch.equal(out[:, 0].float(), rows.float())


def fp8_paged(seq_lens, kv_heads, head_dim, seed=0):
    return make_paged_kv(seq_lens, kv_heads, head_dim, FP8, torch.device("cpu"), seed=seed)


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 0.0), (0, 30.0)])
def test_native_decode_over_fp8_matches_the_reference(dtype, window, softcap):
    kv = fp8_paged([1, 15, 16, 17, 70], 2, 64)
    q = randn((5, 8, 64), dtype, torch.device("cpu"))
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    got = cpu_native.paged_decode_attention(*args, window=window, softcap=softcap)
    want = reference.paged_decode_attention(*args, window=window, softcap=softcap)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [0, 9])
def test_native_prefill_over_fp8_matches_the_reference(dtype, window):
    kv = fp8_paged([40, 17], 2, 64)
    new = [25, 17]  # the first sequence has a cached prefix of 15 tokens
    q = randn((sum(new), 4, 64), dtype, torch.device("cpu"))
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125, window)
    got = cpu_native.paged_prefill_attention(*args)
    want = reference.paged_prefill_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_scales_fold_into_attention_as_code_times_scale():
    """ops with k_scale / v_scale equals the reference over a cache holding code * scale."""
    kv = fp8_paged([30, 5], 1, 32)
    q = randn((2, 2, 32), torch.float32, torch.device("cpu"))
    k_scale, v_scale = 0.25, 3.0
    ops.set_backend("reference")
    try:
        got = ops.paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.2,
                                         k_scale=k_scale, v_scale=v_scale)
    finally:
        ops.set_backend(None)
    k_values, v_values = kv.k_cache.float() * k_scale, kv.v_cache.float() * v_scale
    want = reference.paged_decode_attention(q, k_values, v_values, kv.block_tables, kv.seq_lens, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@native
def test_native_dispatch_takes_fp8_caches():
    kv = fp8_paged([3], 1, 32)
    q = torch.zeros((1, 2, 32))
    assert cpu_native.supports(q, kv.k_cache, kv.v_cache)
    assert cpu_native.supports_prefill(q, kv.k_cache, kv.v_cache)
    k = torch.zeros((1, 1, 32))
    cos = torch.ones(1, 32)
    assert cpu_fused.rotary_store_supported(q, k, k, cos, cos, kv.k_cache, kv.v_cache)
    assert not cpu_native.supports(q.half(), kv.k_cache, kv.v_cache)


# Triton (the interpreter on CPU; compiled on a GPU): the same checks over the same caches.

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kv_write_is_bit_equal_to_torchs_cast(device, dtype):
    values = as_rows(every_value(dtype)[:4096], 2, 64).to(device)
    n = values.shape[0]
    k_cache = torch.zeros((n, 1, 2, 64), dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    triton_ops.store_kv(values, values, k_cache, v_cache, torch.arange(n, device=device), 0.5, 2.0)
    assert same_codes(k_cache.view(n, 2, 64), values.div(0.5).to(FP8))
    assert same_codes(v_cache.view(n, 2, 64), values.div(2.0).to(FP8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_decode_over_fp8_matches_the_reference(device, dtype):
    kv = make_paged_kv([1, 17, 40], 2, 64, FP8, device)
    q = randn((3, 4, 64), dtype, device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    for splits in (1, 3):
        got = triton_ops.paged_decode_attention(*args, splits)
        torch.testing.assert_close(got.float(), reference.paged_decode_attention(*args).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_prefill_over_fp8_matches_the_reference(device, dtype):
    kv = make_paged_kv([40, 17], 2, 64, FP8, device)
    new = [25, 17]
    q = randn((sum(new), 4, 64), dtype, device)
    cu = torch.tensor([0, new[0], sum(new)], dtype=torch.int32, device=device)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.seq_lens, 0.125)
    got = triton_ops.paged_prefill_attention(*args)
    torch.testing.assert_close(got.float(), reference.paged_prefill_attention(*args).float(), **TOL[dtype])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_fp8_blocks_pack_and_unpack_byte_for_byte(device, impl):
    kernels = reference if impl == "reference" else triton_ops
    gen = torch.Generator().manual_seed(5)
    src = torch.randn((6, 2, 2, 4, 2, 8), generator=gen).to(FP8).to(device)
    dst = torch.zeros_like(src)
    packed = kernels.pack_blocks(src, torch.tensor([4, 1, 3], device=device))
    kernels.unpack_blocks(packed, dst, torch.tensor([0, 5, 2], device=device))
    assert torch.equal(dst[[0, 5, 2]].view(torch.uint8), src[[4, 1, 3]].view(torch.uint8))
    assert not dst[[1, 3, 4]].view(torch.uint8).any()


def test_the_engine_over_fp8_kv_gives_the_same_tokens_with_triton(make_ckpt, device):
    """Every op forced through Triton (interpreter here) against the torch reference, both
    over an fp8 pool: a chunked prefill (24-token step budget) mixed with decode steps."""
    from splitserve.engine import LLM, SamplingParams

    path = str(make_ckpt("llama"))
    prompts = [list(range(11, 51)), list(range(300, 309))]
    tokens = {}
    for backend in ("reference", "triton"):
        ops.set_backend(backend)
        try:
            llm = LLM(path, num_kv_blocks=32, max_num_batched_tokens=24, device=str(device), cuda_graphs=False,
                      kv_cache_dtype="fp8")
            assert llm.engine.runner.kv_pool.data.dtype == FP8
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            tokens[backend] = [o.token_ids for o in outs]
        finally:
            ops.set_backend(None)
    assert tokens["triton"] == tokens["reference"]
