"""Weight-only quantized linear layers on the GPU: one Triton GEMM for every QuantizedWeight
layout (kernels/quant_weight.py), y = x @ dequantize(qw).T (+ bias).
FP4 (E2M1 nibbles, MXFP4 / NVFP4) is decoded from its bits: magnitude m = nibble & 7 is
m / 2 for m < 2, else 2^(m // 2 - 1) * (1 + (m % 2) / 2), built as float32 bits.

Each program computes a [BLOCK_M, BLOCK_N] tile of y. Per step along K it loads the codes of
its BLOCK_N weight rows (4-bit: the byte holding each column's nibble; 5..8-bit: one byte per
code; fp8: the e4m3 byte decoded from its bits), dequantises them in registers with the
group's scale and offset, and multiplies them into x's tile with `tl.dot`, accumulating in
float32. The weight is never written out as floats: the point is reading 1/8 to 1/4 of the
float32 bytes (1/4 to 1/2 of bf16's).

Numerics: float32 x is multiplied exactly ("ieee"), so only the accumulation order differs
from the reference. With bfloat16 / float16 x the dequantised tile is rounded to x's dtype for
the tensor cores, as GPTQ / AWQ GPU kernels do (the interpreter, lacking bfloat16 dots, keeps
float32). FP8 codes whose bits are NaN (0x7f, 0xff) are not decoded as NaN: checkpoints hold none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.quant_weight import FP8, QuantizedWeight
from splitserve.kernels.triton_common import dot_precision, kernel, upcast_dot

BLOCK_N = 64


@kernel(do_not_specialize=["M"])
def _quant_linear_kernel(
    x_ptr, codes_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr, M, N, K, stride_x, stride_codes, stride_out,
    GROUP: tl.constexpr, BITS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FLOAT32: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        row = rn[:, None].to(tl.int64) * stride_codes
        if BITS == 4:  # column 2j in the low nibble of byte j, 2j + 1 in the high one
            byte = tl.load(codes_ptr + row + rk[None, :] // 2, mask=w_ok, other=0).to(tl.int32)
            code = ((byte >> ((rk[None, :] % 2) * 4)) & 15).to(tl.float32)
        elif BITS == 1:  # fp4 e2m1 nibbles, packed as the 4-bit codes
            byte = tl.load(codes_ptr + row + rk[None, :] // 2, mask=w_ok, other=0).to(tl.int32)
            nibble = (byte >> ((rk[None, :] % 2) * 4)) & 15
            exponent, mantissa = (nibble >> 1) & 3, nibble & 1
            normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
            magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
            code = tl.where(nibble >= 8, -magnitude, magnitude)
        elif BITS == 0:  # fp8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits
            byte = tl.load(codes_ptr + row + rk[None, :], mask=w_ok, other=0).to(tl.int32)
            exponent, mantissa = (byte >> 3) & 15, byte & 7
            normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
            magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m 2^-9
            code = tl.where(byte >= 128, -magnitude, magnitude)
        else:
            code = tl.load(codes_ptr + row + rk[None, :], mask=w_ok, other=0).to(tl.float32)
        if GROUP % BLOCK_K == 0:  # the tile inside one group (the launcher's choice): a scale per row
            group_at = rn * groups + k0 // GROUP
            w = code * tl.load(scales_ptr + group_at, mask=n_ok, other=0.0)[:, None]
            if HAS_OFFSETS:
                w += tl.load(offsets_ptr + group_at, mask=n_ok, other=0.0)[:, None]
        else:  # groups narrower than 16 columns or not a multiple of 16 wide: a scale per element
            group_at = rn[:, None] * groups + rk[None, :] // GROUP
            w = code * tl.load(scales_ptr + group_at, mask=w_ok, other=0.0)
            if HAS_OFFSETS:
                w += tl.load(offsets_ptr + group_at, mask=w_ok, other=0.0)
        if DOT_FLOAT32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=PRECISION)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_k(group: int, widest: int) -> int:
    """The widest of 64 / 32 / 16 (up to `widest`) dividing the group (one scale per row per
    step); 32 otherwise."""
    return next((b for b in (64, 32, 16) if b <= widest and group % b == 0), 32)


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as quant_weight.quantized_linear_reference (float32 accumulation)."""
    what = "quantized_linear"
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"{what}: x has {x.shape[-1]} features, the quantized weight expects {qw.in_features}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: x must be float32, bfloat16 or float16, got {x.dtype}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, qw.in_features)
    if qw.input_perm is not None:
        rows = rows.index_select(1, qw.input_perm.to(rows.device))
    rows = rows.contiguous()
    codes = qw.codes.view(torch.uint8) if qw.bits == FP8 else qw.codes
    tensors = [rows, codes, qw.scales] + [t for t in (qw.offsets, bias) if t is not None]
    launch = _quant_linear_kernel.for_tensors(what, *tensors)
    m, n, k = rows.shape[0], qw.out_features, qw.in_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dot_float32 = x.dtype == torch.float32 or upcast_dot(x.dtype, x.device)
    if m:
        block_m = 16 if m <= 16 else (32 if m <= 32 or x.dtype == torch.float32 else 64)  # float32: fewer registers
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        launch[grid](rows, codes.contiguous(), qw.scales.contiguous(), _or(qw.offsets, qw.scales),
                     _or(bias, qw.scales), out, m, n, k, rows.stride(0), codes.shape[1], out.stride(0),
                     GROUP=qw.group_size, BITS=qw.bits, HAS_OFFSETS=qw.offsets is not None,
                     HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=_block_k(qw.group_size, 32 if x.dtype == torch.float32 else 64),
                     PRECISION=dot_precision(torch.float32 if dot_float32 else x.dtype), DOT_FLOAT32=dot_float32,
                     num_warps=4)
    return out.reshape(*lead, n)


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel never reads (its HAS_ flag is off)."""
    return placeholder if t is None else t.contiguous()
