"""RMSNorm and neox rotary (Triton) against the references."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference, triton_ops
from tests.kernels.paged_cases import randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One unit in the last place of values up to ~4 (the kernels round once where the
# references round after each op, and rsqrt may differ by an ulp before rounding).
ULP_TOLERANCE = {
    torch.float32: {"atol": 2e-6, "rtol": 2e-6},
    torch.float16: {"atol": 4e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 3.2e-2, "rtol": 8e-3},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 4096), (1, 896)])
def test_rms_norm_matches_reference(device, dtype, shape):
    x = randn(shape, dtype, device) * 3
    weight = randn(shape[-1:], dtype, device, seed=2)
    out = triton_ops.rms_norm(x, weight, 1e-6)
    expected = reference.rms_norm(x, weight, 1e-6)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **ULP_TOLERANCE[dtype])


def test_rms_norm_float32_weight_promotes_like_the_reference(device):
    x = randn((4, 64), torch.bfloat16, device)
    weight = randn((64,), torch.float32, device, seed=2)
    out = triton_ops.rms_norm(x, weight, 1e-5)
    expected = reference.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    # the normalised row is rounded to bfloat16 on both sides before the weight multiplies
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=8e-3)


def test_rms_norm_of_a_strided_row_view(device):
    x = randn((6, 128), torch.float32, device)[::2, :64]
    weight = randn((64,), torch.float32, device, seed=2)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               **ULP_TOLERANCE[torch.float32])


def rotary_tables(n: int, dim: int, dtype, device, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(n, dtype=torch.float32)[:, None] * 37.0 * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 1, 128), (14, 2, 64)])
def test_rotary_matches_reference(device, dtype, heads, kv_heads, dim):
    q = randn((9, heads, dim), dtype, device)
    k = randn((9, kv_heads, dim), dtype, device, seed=2)
    cos, sin = rotary_tables(9, dim, dtype, device)
    q_out, k_out = triton_ops.apply_rotary(q, k, cos, sin)
    q_ref, k_ref = reference.apply_rotary(q, k, cos, sin)
    assert q_out.dtype == q_ref.dtype and k_out.shape == k_ref.shape
    torch.testing.assert_close(q_out, q_ref, **ULP_TOLERANCE[dtype])
    torch.testing.assert_close(k_out, k_ref, **ULP_TOLERANCE[dtype])
    assert torch.equal(q, randn((9, heads, dim), dtype, device))  # inputs left alone


def test_rotary_of_a_query_view_from_fused_qkv(device):
    qkv = randn((3, 12, 64), torch.float32, device)
    q, k = qkv[:, :8], qkv[:, 8:10]
    cos, sin = rotary_tables(3, 64, torch.float32, device)
    got = triton_ops.apply_rotary(q, k, cos, sin)
    want = reference.apply_rotary(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **ULP_TOLERANCE[torch.float32])


def test_rotary_rejects_odd_dims_and_bad_tables(device):
    q = torch.zeros((2, 2, 63), device=device)
    with pytest.raises(ValueError, match="even head dim"):
        triton_ops.apply_rotary(q, q, torch.zeros((2, 63), device=device), torch.zeros((2, 63), device=device))
    q = torch.zeros((2, 2, 64), device=device)
    with pytest.raises(ValueError, match=r"cos and sin must be \[n=2, dim=64\]"):
        triton_ops.apply_rotary(q, q, torch.zeros((2, 32), device=device), torch.zeros((2, 32), device=device))
