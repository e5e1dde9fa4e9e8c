"""The native CPU small ops (kernels/cpu_fused.py + cpu_fused_ops.cpp), built for real: RMSNorm
(Llama and Gemma forms), rotary + KV-cache write (full and partial rotary, GQA, the strided
q/k/v views a qkv projection gives), and the gated MLP's activation * up (SiLU, GELU-tanh),
each against the torch reference in float32 and bfloat16; a bad slot refused before anything
is written; and the dispatch in ops.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import cpu_fused, ops, reference

DTYPES = [torch.float32, torch.bfloat16]
# float32: the same formula in another summation order. bfloat16: the reference's rounding
# steps are replayed, so results differ by at most one bfloat16 ulp where a float32 sum
# lands on a rounding boundary.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}


def gen(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [256, 80, 7])
def test_rms_norm_matches_the_reference(dtype, hidden):
    x, w = gen(9, hidden, dtype=dtype), gen(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **TOL[dtype])
    gemma = reference.rms_norm(x.float(), w.float() + 1.0, 1e-6).to(dtype)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6, gemma=True), gemma, **TOL[dtype])


def test_rms_norm_of_strided_rows_and_heads():
    """q_norm/k_norm normalise each head of a [n, heads, dim] view of the qkv projection."""
    qkv = gen(5, 3 * 64)
    q = qkv[:, :128].reshape(5, 2, 64)  # rows 192 apart
    w = gen(64, seed=2)
    got = cpu_fused.rms_norm(q, w, 1e-5)
    assert got.shape == (5, 2, 64)
    torch.testing.assert_close(got, reference.rms_norm(q, w, 1e-5), **TOL[torch.float32])
    rows = qkv[:, 64:128]  # a 2-D slice: its rows are read in place, 192 apart
    torch.testing.assert_close(cpu_fused.rms_norm(rows, w, 1e-5), reference.rms_norm(rows, w, 1e-5),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, gemma):
    """The sum is torch's add bit for bit (it is the residual stream every later layer reads);
    the norm of it as rms_norm's. Rows of x are read in place from a wider buffer."""
    wide, delta, w = gen(6, 300, dtype=dtype), gen(6, 256, dtype=dtype, seed=1), gen(256, dtype=dtype, seed=2)
    x = wide[:, :256]  # rows 300 apart
    total, normed = cpu_fused.add_rms_norm(x, delta, w, 1e-6, gemma)
    torch.testing.assert_close(total, x + delta, rtol=0, atol=0)
    want = (reference.rms_norm((x + delta).float(), w.float() + 1.0, 1e-6).to(dtype) if gemma
            else reference.rms_norm(x + delta, w, 1e-6))
    torch.testing.assert_close(normed, want, **TOL[dtype])
    torch.testing.assert_close(normed, cpu_fused.rms_norm(x + delta, w, 1e-6, gemma), rtol=0, atol=0)


def test_ops_add_rms_norm_takes_native_only_for_same_shaped_rows(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    calls = []
    original = cpu_fused.add_rms_norm
    monkeypatch.setattr(cpu_fused, "add_rms_norm", lambda *a: calls.append(a[0].dtype) or original(*a))
    w = gen(16, seed=1)
    for x, delta in ((gen(3, 16), gen(3, 16, seed=2)), (gen(3, 16).half(), gen(3, 16, seed=2).half()),
                     (gen(3, 16), gen(1, 16, seed=2))):  # float16, then a broadcast delta: the add, then the norm
        total, normed = ops.add_rms_norm(x, delta, w.to(x.dtype), 1e-6)
        torch.testing.assert_close(total, x + delta, rtol=0, atol=0)
        torch.testing.assert_close(normed, reference.rms_norm(x + delta, w.to(x.dtype), 1e-6), **TOL[torch.float32])
    assert calls == [torch.float32]


def _pool(blocks, block_size, kv_heads, dim, dtype):
    shape = (blocks, block_size, kv_heads, dim)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


def _reference_rotary_store(q, k, v, cos, sin, slots, block_size, kv_heads, dim, dtype):
    k_cache, v_cache = _pool(8, block_size, kv_heads, dim, dtype)
    rot = cos.shape[-1]
    q_rot, k_rot = reference.apply_rotary(q[..., :rot].contiguous(), k[..., :rot].contiguous(), cos, sin)
    q_out, k_out = torch.cat([q_rot, q[..., rot:]], -1), torch.cat([k_rot, k[..., rot:]], -1)
    reference.store_kv(k_out, v, k_cache, v_cache, slots)
    return q_out, k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim,rot", [(8, 4, 32, 32), (4, 1, 64, 64), (6, 2, 48, 16)])
def test_rotary_and_store_kv_match_the_reference(dtype, heads, kv_heads, dim, rot):
    n, block_size = 5, 4
    qkv = gen(n, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(n, heads, dim), k.reshape(n, kv_heads, dim), v.view(n, kv_heads, dim)
    angles = gen(n, rot // 2, seed=3)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    slots = torch.tensor([5, 0, 31, 17, 12])  # scattered over blocks 0..7
    want_q, want_k, want_v = _reference_rotary_store(q, k, v, cos, sin, slots, block_size, kv_heads, dim, dtype)
    k_cache, v_cache = _pool(8, block_size, kv_heads, dim, dtype)
    assert cpu_fused.rotary_store_supported(q, k, v, cos, sin, k_cache, v_cache)
    got_q = cpu_fused.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    # the five slots hold the same rows; every other slot is untouched (still NaN)
    torch.testing.assert_close(k_cache, want_k, equal_nan=True, **TOL[dtype])
    assert torch.equal(v_cache.isnan(), want_v.isnan()) and torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())


@pytest.mark.parametrize("bad_slot", [-1, 8 * 4])
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(bad_slot):
    q, k, v = gen(3, 2, 32), gen(3, 1, 32, seed=1), gen(3, 1, 32, seed=2)
    cos, sin = gen(3, 32, seed=3), gen(3, 32, seed=4)
    k_cache, v_cache = _pool(8, 4, 1, 32, torch.float32)
    with pytest.raises(ValueError, match="block id is outside the KV pool"):
        cpu_fused.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([3, bad_slot, 9]))
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul_matches_the_reference(dtype, gelu):
    x = gen(7, 2 * 352, dtype=dtype) * 4  # gates far into both tails of the activation
    gate, up = x.split(352, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    torch.testing.assert_close(cpu_fused.act_and_mul(x, gelu), want, **TOL[dtype])


def test_act_and_mul_saturates_without_inf_or_nan():
    """The exp is clamped, not overflowed: far tails give ~0 and the gate itself."""
    x = torch.tensor([[-1000.0, -90.0, 0.0, 90.0, 1000.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for gelu in (False, True):
        got = cpu_fused.act_and_mul(x, gelu)
        assert got.isfinite().all(), (gelu, got)
        torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 0.0, 90.0, 1000.0]]), atol=1e-30, rtol=0)


def test_ops_dispatch_native_on_cpu_and_the_reference_for_float16(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    calls = []
    original = cpu_fused.act_and_mul
    monkeypatch.setattr(cpu_fused, "act_and_mul", lambda *a: calls.append("native") or original(*a))
    for dtype in (torch.float32, torch.float16):
        x = gen(2, 16, dtype=dtype)
        gate, up = x.split(8, dim=-1)
        torch.testing.assert_close(ops.act_and_mul(x), F.silu(gate) * up)
    assert calls == ["native"]
    monkeypatch.setenv("SPLITSERVE_KERNELS", "reference")
    ops.act_and_mul(gen(2, 16))
    assert calls == ["native"]  # the reference, as asked


def test_rotary_store_declines_a_cache_of_another_geometry():
    """The kernel trusts the geometry it is given, so the check before it must not."""
    q, k, v = gen(3, 4, 32), gen(3, 2, 32, seed=1), gen(3, 2, 32, seed=2)
    cos, sin = gen(3, 32, seed=3), gen(3, 32, seed=4)
    assert cpu_fused.rotary_store_supported(q, k, v, cos, sin, *_pool(8, 4, 2, 32, torch.float32))
    assert not cpu_fused.rotary_store_supported(q, k, v, cos, sin, *_pool(8, 4, 1, 32, torch.float32))
    assert not cpu_fused.rotary_store_supported(q, k, v, cos, sin, *_pool(8, 4, 2, 64, torch.float32))
    assert not cpu_fused.rotary_store_supported(q, k, v, gen(3, 64), gen(3, 64), *_pool(8, 4, 2, 32, torch.float32))
