"""The Triton GEMV of small decode batches on a GPU (kernels/triton_gemv.py), through the
interpreter here and compiled in the GPU check's kernel stage: against a float32 matmul,
with a bias, shapes that are no multiple of its tiles, a strided x, and each row's bits
independent of how many rows share the launch (the CUDA graphs' padded buckets)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import ops, triton_gemv


def _case(device, dtype, m: int, n: int = 40, k: int = 1500, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_a_float32_matmul(device, dtype, m, with_bias):
    x, w, b = _case(device, dtype, m)
    bias = b if with_bias else None
    got = triton_gemv.gemv(x, w, bias)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (m, 40)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # one rounding to 16 bits


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(device):
    x, w, b = _case(device, torch.bfloat16, 4)
    alone = [triton_gemv.gemv(x[i:i + 1], w, b) for i in range(4)]
    together = triton_gemv.gemv(x, w, b)
    for i in range(4):
        assert torch.equal(together[i], alone[i][0])


def test_a_strided_x_and_leading_dimensions(device):
    x, w, _ = _case(device, torch.bfloat16, 2, k=256)
    wide = torch.zeros(2, 512, dtype=torch.bfloat16, device=device)
    wide[:, ::2] = x
    got = triton_gemv.gemv(wide[:, ::2].reshape(1, 2, 256), w)
    assert got.shape == (1, 2, 40)
    assert torch.equal(got[0], triton_gemv.gemv(x, w))


def test_what_ops_linear_sends_to_it():
    x, w, _ = _case("cpu", torch.bfloat16, 4)
    assert triton_gemv.eligible(x, w)
    assert not triton_gemv.eligible(torch.cat([x, x[:1]]), w)  # 5 rows: cuBLAS
    assert not triton_gemv.eligible(x.float(), w.float())  # float32: cuBLAS
    assert not triton_gemv.eligible(x, w.t().contiguous().t())  # a column-major weight
    with pytest.raises(ValueError, match="1..4 rows"):
        triton_gemv.gemv(torch.cat([x, x[:1]]), w)
    # on the CPU ops.linear never takes it (the native backend's own gemv, or F.linear)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
