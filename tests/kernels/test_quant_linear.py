"""The dequantising linear kernels (native CPU: quant_native / cpu_quant_linear.cpp; GPU:
triton_quant, here through Triton's interpreter) against quant_weight.quantized_linear_reference,
for every QuantizedWeight layout: 4-bit nibbles, 5/6/8-bit bytes, fp8 e4m3 codes (every byte
value but NaN's), fp4 e2m1 nibbles (MXFP4 / NVFP4), groups of 16 to 128 columns, with and without offsets, input_perm and bias,
decode-sized and prefill-sized x in float32 and bfloat16, K and N off the kernels' tiles.

Tolerance: the kernels compute the reference's sum in float32 in another order (and fuse
code * scale + offset into one rounding), so |got - want| <= 1e-5 * sum_k |x_k w_k|, a float32
accumulation bound; bfloat16 outputs may round to the neighbouring bfloat16 on top (2^-7 of |y|).
On a GPU, bfloat16 x meets a weight tile rounded to bfloat16 (tensor cores): 2^-8 of the sum."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from splitserve.kernels import cpu_native, ops, quant_native
from splitserve.kernels.quant_weight import FP4, FP8, QuantizedWeight, quantized_linear_reference

BITS = [4, 5, 6, 8, FP8]  # FP4 has its own, smaller cases (no offsets to vary)
GROUPS = [16, 32, 64, 128]
ROWS = [1, 3, 16, 65, 300]
DTYPES = [torch.float32, torch.bfloat16]
native = pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the native CPU kernels")


def make_weight(n: int, k: int, bits: int, group: int, offsets: bool = True, perm: bool = False,
                device="cpu", seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    if bits in (4, FP4):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        offsets = offsets and bits == 4
    elif bits == FP8:  # every e4m3 byte but the two NaNs, subnormals included
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=gen)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        codes = codes.view(torch.float8_e4m3fn)
    else:
        codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) + 0.5) / 2**bits
    zero = -(torch.rand(n, k // group, generator=gen) + 0.5) / 2 if offsets else None
    input_perm = torch.randperm(k, generator=gen) if perm else None
    qw = QuantizedWeight(codes, scales, zero, bits, group, k, n, input_perm)
    if device != "cpu":
        qw = QuantizedWeight(*(t.to(device) if t is not None else None for t in (qw.codes, qw.scales, qw.offsets)),
                             bits, group, k, n, None if input_perm is None else input_perm.to(device))
    return qw


def assert_matches_reference(got: torch.Tensor, x: torch.Tensor, qw: QuantizedWeight, bias=None,
                             weight_rounding: float = 0.0) -> None:
    cpu = QuantizedWeight(*(t.cpu() if t is not None else None for t in (qw.codes, qw.scales, qw.offsets)),
                          qw.bits, qw.group_size, qw.in_features, qw.out_features,
                          None if qw.input_perm is None else qw.input_perm.cpu())
    x, got = x.cpu(), got.cpu()
    want = quantized_linear_reference(x, cpu, None if bias is None else bias.cpu())
    assert got.dtype == x.dtype and got.shape == want.shape
    magnitude = x.float().abs() @ cpu.dequantize().abs().T  # sum_k |x_k w_k|
    bound = (1e-5 + weight_rounding) * magnitude + 1e-6
    if x.dtype == torch.bfloat16:
        bound += 2**-7 * want.float().abs()  # one bfloat16 ulp
    error = (got.float() - want.float()).abs()
    worst = (error - bound).argmax()
    assert (error <= bound).all(), f"error {error.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"


def x_rows(m: int, k: int, dtype, device="cpu", seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


# --- native CPU ---------------------------------------------------------------------------------------------

@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_native_matches_the_reference(bits, group, offsets, dtype):
    """Every M of ROWS: 300 rows span two of the kernel's x blocks where K is 384 (168 rows each)."""
    qw = make_weight(93, 384, bits, group, offsets=offsets and bits != FP8)  # 93: off the 2-row and 16-row blocks
    bias = torch.randn(93)
    assert quant_native.supports(x_rows(1, 384, dtype), qw)
    for m in ROWS:
        x = x_rows(m, 384, dtype)
        assert_matches_reference(quant_native.quantized_linear(x, qw), x, qw)
        assert_matches_reference(quant_native.quantized_linear(x, qw, bias), x, qw, bias)


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [16, 32, 128])
def test_native_fp4_matches_the_reference(group, dtype):
    """E2M1 nibbles: groups of 16 through the nibble -> e4m3 byte shuffle, multiples of 32 (on
    AVX-512) through the lookup of the group's 16 values."""
    qw = make_weight(93, 384, FP4, group)
    bias = torch.randn(93)
    for m in ROWS:
        x = x_rows(m, 384, dtype)
        assert_matches_reference(quant_native.quantized_linear(x, qw, bias), x, qw, bias)


@native
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("bits", [4, 8, FP8, FP4])
def test_native_with_input_perm_bias_and_leading_dims(bits, rows):
    qw = make_weight(70, 256, bits, 32, offsets=bits not in (FP8, FP4), perm=True)
    bias = torch.randn(70).to(torch.bfloat16)
    x = x_rows(rows, 256, torch.float32)
    assert_matches_reference(quant_native.quantized_linear(x, qw, bias), x, qw, bias)
    got = quant_native.quantized_linear(x.reshape(1, rows, 256), qw, bias)
    assert got.shape == (1, rows, 70)
    torch.testing.assert_close(got[0], quant_native.quantized_linear(x, qw, bias), rtol=0, atol=0)


@native
def test_native_uses_several_torch_threads_with_the_same_result():
    qw = make_weight(200, 512, 4, 128)
    x1, x300 = x_rows(1, 512, torch.float32), x_rows(300, 512, torch.float32)
    one = [quant_native.quantized_linear(x, qw) for x in (x1, x300)]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        three = [quant_native.quantized_linear(x, qw) for x in (x1, x300)]
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three, strict=True):  # rows split between threads; each output element summed the same way
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@native
def test_ops_dispatches_native_and_falls_back_where_native_cannot():
    qw = make_weight(40, 96, 6, 16)
    x = x_rows(2, 96, torch.float32)
    ops.set_backend("native")
    try:
        assert_matches_reference(ops.quantized_linear(x, qw), x, qw)
        odd = make_weight(40, 96, 8, 24)  # groups of 24 columns: not the kernel's 16-column chunks
        assert not quant_native.supports(x, odd)
        torch.testing.assert_close(ops.quantized_linear(x, odd), quantized_linear_reference(x, odd), rtol=0, atol=0)
        assert not quant_native.supports(x.half(), qw)  # float16 x: the reference
    finally:
        ops.set_backend(None)


@native
def test_native_rejects_x_of_the_wrong_width():
    with pytest.raises(ValueError, match="x has 95 features, the quantized weight expects 96"):
        quant_native.quantized_linear(torch.randn(2, 95), make_weight(40, 96, 4, 32))


def _cpu_has(*flags: str) -> bool:
    try:
        line = next(ln for ln in open("/proc/cpuinfo").read().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return all(f in line.split() for f in flags)


def _run_here_built_for(march: str) -> None:
    env = {**os.environ, "SPLITSERVE_CPU_MARCH": march, "SPLITSERVE_TEST_BUDGET": "off"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", __file__,
                           "-k", "native and not built"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout and " skipped" not in done.stdout


@native
@pytest.mark.skipif(not _cpu_has("avx2", "fma", "f16c"), reason="this CPU cannot run an AVX2 build")
@pytest.mark.skipif(cpu_native.MARCH != "native", reason="already a cross build")
def test_native_built_for_avx2_matches_the_reference_too():
    """The kernel's other register shape (AVX2: two 8-lane halves per 16 codes, one weight row a pass)."""
    _run_here_built_for("haswell")


@native
@pytest.mark.full
@pytest.mark.skipif(cpu_native.MARCH != "native", reason="already a cross build")
def test_native_built_without_avx2_matches_the_reference_too():
    """The portable scalar path (CPUs without AVX2, and Arm until it has its own)."""
    _run_here_built_for("x86-64")


# --- Triton (the interpreter on a CPU-only machine) ---------------------------------------------------------

def _triton_case(device, bits, group, offsets, perm, rows, dtype, with_bias, n=70, k=384):
    from splitserve.kernels import triton_quant

    qw = make_weight(n, k, bits, group, offsets=offsets and bits not in (FP8, FP4), perm=perm, device=device)
    x = x_rows(rows, k, dtype, device)
    bias = torch.randn(n).to(device) if with_bias else None
    rounding = 2**-8 if device.type == "cuda" and dtype != torch.float32 else 0.0
    assert_matches_reference(triton_quant.quantized_linear(x, qw, bias), x, qw, bias, rounding)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [*BITS, FP4])
def test_triton_matches_the_reference(device, bits, dtype):
    _triton_case(device, bits, 32, True, False, 3, dtype, True)


@pytest.mark.parametrize("rows", ROWS)
def test_triton_rows_off_the_tile(device, rows):
    _triton_case(device, 4, 64, True, rows == 3, rows, torch.float32, rows == 65)


@pytest.mark.parametrize("group", [16, 128, 24])  # 24: a scale per element; K = 312 off the 32-column step
def test_triton_groups(device, group):
    _triton_case(device, 8, group, True, True, 2, torch.float32, False, n=33, k=group * 13)


@pytest.mark.full
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("bits", BITS)
def test_triton_sweep(device, bits, group, offsets, rows, dtype):
    _triton_case(device, bits, group, offsets, rows == 3, rows, dtype, rows != 1)


def test_ops_dispatches_triton(device):
    qw = make_weight(20, 64, 5, 16, device=device)
    x = x_rows(4, 64, torch.float32, device)
    ops.set_backend("triton")
    try:
        assert_matches_reference(ops.quantized_linear(x, qw), x, qw)
    finally:
        ops.set_backend(None)
