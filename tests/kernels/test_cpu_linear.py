"""float32 CPU linears (kernels/cpu_linear.py): oneDNN from two rows up, the native gemv
(cpu_dense_gemv.cpp) for one row, F.linear for other dtypes and the reference backend; the same
results to float32 rounding, on the input-major weights the loader stores and on output-major
ones (a tied LM head); a build whose oneDNN refuses falls back, once, for good."""

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels import cpu_linear, cpu_native, ops

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


@pytest.fixture
def gemv_calls(monkeypatch):
    """Weight shapes each native gemv call got."""
    seen = []
    real = cpu_linear.gemv

    def spy(x, weight, bias):
        seen.append(tuple(weight.shape))
        return real(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "gemv", spy)
    return seen


@pytest.mark.parametrize("rows", [1, 2, 8, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_same_result_as_f_linear_and_one_row_takes_the_gemv(calls, gemv_calls, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g), input_major(960, 576, g)
    bias = torch.randn(960, generator=g) if with_bias else None
    got, want = ops.linear(x, w, bias), F.linear(x, w, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert calls == ([] if rows == 1 else [rows])
    assert gemv_calls == ([(960, 576)] if rows == 1 else [])


needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler: no native kernels")


@needs_native
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (3072, 576), (1030, 40), (17, 33), (1, 5), (4, 1)])
@pytest.mark.parametrize("layout", ["input-major", "output-major"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_row_gemv_matches_f_linear_in_both_layouts(gemv_calls, n, k, layout, threads):
    """Every pass width and tail of the kernel (k not a multiple of 8 or 16, n not of 16, one
    output), split over two threads too."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    w = input_major(n, k, g) if layout == "input-major" else w
    x, bias = torch.randn(1, 1, k, generator=g), torch.randn(n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, got_no_bias = ops.linear(x, w, bias), ops.linear(x, w)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_no_bias, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert got.shape == (1, 1, n) and gemv_calls == [(n, k)] * 2


def test_one_row_of_a_strided_weight_or_without_the_library_uses_f_linear(gemv_calls, monkeypatch):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 64, generator=g), torch.randn(32, 128, generator=g)[:, ::2]  # neither layout
    assert torch.equal(ops.linear(x, w), F.linear(x, w)) and gemv_calls == []
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    w = torch.randn(32, 64, generator=g)
    assert torch.equal(ops.linear(x, w), F.linear(x, w)) and gemv_calls == []


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


@pytest.mark.parametrize("rows", [1, 2, 8, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_weight_gives_f_linears_result_at_every_row_count_and_backend(rows, with_bias):
    """The loader's packed weights (models/loader.py) go through oneDNN whatever the backend:
    nothing else can read them."""
    g = torch.Generator().manual_seed(rows + 10)
    w, x = torch.randn(960, 576, generator=g), torch.randn(rows, 576, generator=g)
    bias = torch.randn(960, generator=g) if with_bias else None
    packed = cpu_linear.pack(w)
    assert packed is not None and packed.is_mkldnn and torch.equal(packed.to_dense(), w)
    for backend in ("native", "reference"):
        ops.set_backend(backend)
        try:
            got = ops.linear(x, packed, bias)
        finally:
            ops.set_backend(None)
        torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_a_build_that_cannot_pack_keeps_the_dense_weight(monkeypatch, caplog):
    def refuse(weight, batch):
        raise RuntimeError("no reorder for this CPU")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse, raising=False)
    assert cpu_linear.pack(torch.randn(1024, 1024)) is None and "they stay dense" in caplog.text


def test_a_small_weight_is_not_packed():
    """Below PACK_MIN_BYTES oneDNN's per-call cost outweighs the layout's gain (the demo model)."""
    assert cpu_linear.pack(torch.randn(768, 256)) is None
    assert cpu_linear.pack(torch.randn(512, 1024)).is_mkldnn  # exactly 2 MiB
