"""float32 CPU linears (kernels/cpu_linear.py): oneDNN from two rows up, MKL (F.linear) for one
row, other dtypes and the reference backend; the same results to float32 rounding, on the
input-major weights the loader stores; a build whose oneDNN refuses falls back, once, for good."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import cpu_linear, ops

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear")


@pytest.fixture
def calls(monkeypatch):
    """Rows each oneDNN call got; _available reset after the test."""
    seen = []
    real = cpu_linear._onednn_linear

    def spy(rows, weight, bias):
        seen.append(rows.shape[0])
        return real(rows, weight, bias)

    monkeypatch.setattr(cpu_linear, "_onednn_linear", spy)
    monkeypatch.setattr(cpu_linear, "_available", None)
    monkeypatch.delenv("SPLITSERVE_KERNELS", raising=False)
    ops.set_backend(None)
    return seen


def input_major(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=g).t().contiguous().t()  # as models/loader.py stores it


@pytest.mark.parametrize("rows", [1, 2, 8, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_same_result_as_f_linear_and_one_row_stays_on_mkl(calls, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), input_major(960, 576, g)
    bias = torch.randn(960, generator=g) if with_bias else None
    got, want = ops.linear(x, w, bias), F.linear(x, w, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert calls == ([] if rows == 1 else [rows])


def test_a_batch_of_rows_in_three_dimensions_keeps_its_shape(calls):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 64, generator=g), input_major(32, 64, g)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [10]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_and_the_reference_backend_use_f_linear(calls, dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(ops.linear(x.to(dtype), w.to(dtype)), F.linear(x.to(dtype), w.to(dtype)))
    ops.set_backend("reference")
    try:
        assert torch.equal(ops.linear(x, w), F.linear(x, w))
    finally:
        ops.set_backend(None)
    assert calls == []


def test_a_refusing_onednn_falls_back_to_mkl_for_the_rest_of_the_process(monkeypatch, caplog):
    def refuse(rows, weight, bias):
        raise RuntimeError("no oneDNN kernel for this CPU")

    monkeypatch.setattr(cpu_linear, "_onednn_linear", refuse)
    monkeypatch.setattr(cpu_linear, "_available", None)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
    assert cpu_linear._available is False and "float32 CPU linears use MKL" in caplog.text
    assert not cpu_linear.eligible(x, w)
