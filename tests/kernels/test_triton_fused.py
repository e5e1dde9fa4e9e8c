"""The GPU's fused small ops (kernels/triton_fused.py) against the op-by-op path they replace:
act(gate) * up against `F.silu(gate) * up` / GELU-tanh, and rotary + KV write in one launch
against the separate rotary and store_kv kernels (bit for bit: the same arithmetic, one
rounding), padding slots untouched, and ops dispatching to them on the Triton backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import ops, triton_fused, triton_ops
from tests.kernels.paged_cases import randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("rows,inter", [(1, 64), (3, 1500), (5, 100)])
def test_act_and_mul_matches_the_op_by_op_reference(device, dtype, gelu, rows, inter):
    x = randn((rows, 2 * inter), dtype, device) * 4  # tails of both activations
    gate, up = x.split(inter, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    got = triton_fused.act_and_mul(x, gelu)
    assert got.dtype == dtype and got.shape == (rows, inter)
    # act(gate) may round one ulp apart (torch's exp is vectorised differently); up * it keeps that ulp
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.isfinite(got).all()


def test_act_and_mul_of_a_row_strided_view(device):
    big = randn((4, 2 * 96 + 32), torch.float32, device)
    x = big[:, :192]  # rows 224 apart, as a slice of a wider matmul output would be
    want = F.silu(x[:, :96]) * x[:, 96:]
    torch.testing.assert_close(triton_fused.act_and_mul(x), want, rtol=2e-6, atol=2e-6)


def test_act_and_mul_rejects_an_odd_width(device):
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        triton_fused.act_and_mul(torch.zeros((2, 7), device=device))


def _case(device, dtype, n, heads, kv_heads, dim, num_blocks=6, block_size=4):
    qkv = randn((n, (heads + 2 * kv_heads) * dim), dtype, device)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
    angles = torch.rand((n, dim // 2), device=device) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    cache = randn((num_blocks, block_size, kv_heads, dim), dtype, device)
    return q, k, v, cos, sin, cache, cache.clone()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (12, 4, 80), (3, 3, 64)])
def test_rotary_and_store_equals_the_separate_kernels_bit_for_bit(device, dtype, heads, kv_heads, dim):
    q, k, v, cos, sin, k_cache, v_cache = _case(device, dtype, 5, heads, kv_heads, dim)
    slots = torch.tensor([0, 7, 9, 22, 13], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_q, k_rot = triton_ops.apply_rotary(q, k, cos, sin)
    triton_ops.store_kv(k_rot, v, want_k, want_v, slots)
    assert triton_fused.rotary_store_supported(q, k, v, cos, sin, k_cache, v_cache)
    got_q = triton_fused.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_padding_slots_write_nothing(device):
    q, k, v, cos, sin, k_cache, v_cache = _case(device, torch.float32, 3, 4, 2, 16)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, -1], device=device)
    triton_fused.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    changed = (k_cache != before_k).flatten(2).any(-1) | (v_cache != before_v).flatten(2).any(-1)
    assert changed.nonzero().tolist() == [[1, 1]]  # slot 5 = block 1, offset 1; nothing else


def test_mixed_dtypes_and_partial_rotary_are_left_to_the_separate_kernels(device):
    q, k, v, cos, sin, k_cache, v_cache = _case(device, torch.bfloat16, 2, 4, 2, 16)
    assert not triton_fused.rotary_store_supported(q, k, v, cos.float(), sin.float(), k_cache, v_cache)
    assert not triton_fused.rotary_store_supported(q, k, v, cos[:, :8], sin[:, :8], k_cache, v_cache)


def test_ops_use_the_fused_kernels_on_the_triton_backend(device, monkeypatch):
    calls = []
    for name in ("act_and_mul", "rotary_and_store_kv"):
        original = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name,
                            lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    q, k, v, cos, sin, k_cache, v_cache = _case(device, torch.float32, 3, 4, 2, 16)
    x = randn((3, 64), torch.float32, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([1, 2, 3], device=device)
    try:
        ops.set_backend("reference")
        want_q, want_act = ops.rotary_and_store_kv(q, k, v, cos, sin, ref_k, ref_v, slots), ops.act_and_mul(x)
        ops.set_backend("triton")
        got_q, got_act = ops.rotary_and_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots), ops.act_and_mul(x)
    finally:
        ops.set_backend(None)
    assert calls == ["rotary_and_store_kv", "act_and_mul"]
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache, ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache, ref_v)
    torch.testing.assert_close(got_act, want_act, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 5120 // 4), (2, 96)])
def test_add_rms_norm_equals_the_add_then_the_norm_kernel_bit_for_bit(device, dtype, rows, hidden):
    x, delta = randn((rows, hidden), dtype, device), randn((rows, hidden), dtype, device)
    weight = randn((hidden,), dtype, device)
    total, normed = triton_fused.add_rms_norm(x, delta, weight, 1e-6)
    want_total = x + delta
    assert torch.equal(total, want_total)
    assert torch.equal(normed, triton_ops.rms_norm(want_total, weight, 1e-6))


def test_add_rms_norm_through_ops_on_both_backends(device):
    x, delta = randn((3, 32), torch.float32, device), randn((3, 32), torch.float32, device)
    weight = randn((32,), torch.float32, device)
    try:
        ops.set_backend("reference")
        want = ops.add_rms_norm(x, delta, weight, 1e-5)
        gemma_want = ops.add_rms_norm(x, delta, weight, 1e-5, gemma=True)
        ops.set_backend("triton")
        got = ops.add_rms_norm(x, delta, weight, 1e-5)
        gemma_got = ops.add_rms_norm(x, delta, weight, 1e-5, gemma=True)  # not fused: x * (1 + w)
    finally:
        ops.set_backend(None)
    for a, b in zip(got + gemma_got, want + gemma_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(gemma_got[1], got[1])


def test_add_rms_norm_rejects_mismatched_inputs(device):
    x = torch.zeros((2, 8), device=device)
    with pytest.raises(ValueError, match="one dtype"):
        triton_fused.add_rms_norm(x, x.double(), torch.ones(8, device=device), 1e-6)
