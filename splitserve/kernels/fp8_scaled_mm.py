"""FP8 weights times FP8 activations (W8A8) through `torch._scaled_mm`: the FP8 tensor cores
of Ada and Hopper GPUs (compute capability 8.9+), as vLLM runs FP8 checkpoints there.

The weight-only path (triton_quant.py) decodes the e4m3 codes to bf16 and multiplies on the
bf16 tensor cores: it reads 1 byte a weight but computes at bf16 rate. Here each token's
activations are quantized to e4m3 with a scale of their own (dynamic per-token: the row's
absolute maximum maps to 448, e4m3's largest finite value), and cuBLAS multiplies FP8 by FP8
with float32 accumulation at twice the bf16 rate, scaling the product by the token's scale
times the weight row's (`scale_a` [M, 1], `scale_b` [1, N]: rowwise scaling).

What it changes numerically: the activations are rounded to e4m3 (3 mantissa bits), so the
result is not the weight-only result; it is exactly `fp8_linear_reference` up to float32
summation order. Which weights: one scale per output row or per tensor (per-channel and
per-tensor FP8 checkpoints: compressed-tensors, `quant_method: fp8` without blocks), K and N
multiples of 16 (cuBLAS's FP8 rule). Block-scaled FP8 (128x128 scales: DeepSeek, Qwen3-FP8)
keeps the weight-only kernel. `torch._scaled_mm` also runs on the CPU, which is how the tests
check this path here; the engine turns it on by itself only on a CUDA device that has FP8
tensor cores (EngineConfig.fp8_activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.kernels.quant_weight import FP8, QuantizedWeight

E4M3_MAX = 448.0
# a token of zeros must not divide by zero; any positive floor below e4m3's smallest subnormal works
MIN_SCALE = 1e-12


@dataclass
class Fp8RowwiseWeight:
    codes: torch.Tensor  # float8_e4m3fn [N, K], row-major (its transpose is the column-major B cuBLAS wants)
    scales: torch.Tensor  # float32 [1, N]
    out_features: int


def device_has_fp8_matmul(device: torch.device | str) -> bool:
    """FP8 tensor cores: NVIDIA compute capability 8.9 (Ada) or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device) >= (8, 9)


def rowwise(qw: QuantizedWeight) -> Fp8RowwiseWeight | None:
    """The weight in `_scaled_mm`'s form, or None where this path cannot compute it exactly
    (not FP8, scales per block of columns, an input permutation, shapes cuBLAS refuses)."""
    if qw.bits != FP8 or qw.offsets is not None or qw.input_perm is not None or qw.group_size != qw.in_features:
        return None
    if qw.in_features % 16 or qw.out_features % 16:
        return None
    return Fp8RowwiseWeight(qw.codes.contiguous(), qw.scales.reshape(1, -1).contiguous(), qw.out_features)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], float32 scales [M, 1]) with x ~= codes * scales."""
    scales = (x.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp_min(MIN_SCALE)
    codes = (x.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def fp8_linear(x: torch.Tensor, w: Fp8RowwiseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) in x's dtype, activations quantized per token."""
    lead = x.shape[:-1]
    codes, scales = quantize_per_token(x.reshape(-1, x.shape[-1]))
    # cuBLAS's rowwise scaling writes bfloat16 only (the CPU writes any float dtype)
    out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
    y = torch._scaled_mm(codes, w.codes.t(), scale_a=scales, scale_b=w.scales, out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*lead, w.out_features)


def fp8_linear_reference(x: torch.Tensor, w: Fp8RowwiseWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What fp8_linear computes, in float32 from its definition (the tests' reference)."""
    codes, scales = quantize_per_token(x.reshape(-1, x.shape[-1]))
    y = (codes.float() * scales) @ (w.codes.float() * w.scales.reshape(-1, 1)).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
