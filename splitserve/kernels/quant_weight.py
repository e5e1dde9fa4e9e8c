"""The one in-memory layout of a weight-only quantized linear weight (issue 31).

Every quantized checkpoint format the engine reads (FP8 block-wise and per-channel,
GPTQ, AWQ, compressed-tensors pack-quantized, GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, MXFP4 and
NVFP4) is converted, exactly, to this: integer (or FP8, FP4) codes and one float32 scale and offset per
group of `group_size` consecutive input columns of an output row,

    w[n, k] = code[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]

so one set of kernels (kernels/ops.quantized_linear) serves them all. Exact because every
format's scale is a float16 (or float32, or float16 times a small integer) and every
code a small integer (an FP4 value: two significant bits): the products and sums above are float32-exact, or rounded once the
way each format's own reference dequantiser rounds them (tests check bit equality).

Codes, by `bits`:
  4      uint8 [N, K // 2], two per byte: column 2j in the low nibble, 2j + 1 in the high
  5..8   uint8 [N, K], one per byte (unsigned: a format's signed or zero-pointed codes are
         folded into `offsets`)
  0      float8_e4m3fn [N, K] (FP8 checkpoints; offsets None)
  1      FP4: uint8 [N, K // 2] E2M1 nibbles packed as the 4-bit codes (MXFP4, NVFP4: sign bit 3,
         values 0, 0.5, 1, 1.5, 2, 3, 4, 6; offsets None), exact in float32 times any scale

`input_perm` (GPTQ act-order): the codes' columns are the layer's input columns in this
order, so that groups are contiguous; y = x[:, input_perm] @ w_perm.T. `dequantize`
returns the weight in the layer's own column order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = 0
FP4 = 1
INT_BITS = (4, 5, 6, 8)
PACKED = (4, FP4)  # two codes a byte
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # FP4 nibble -> value


@dataclass
class QuantizedWeight:
    codes: torch.Tensor
    scales: torch.Tensor  # float32 [N, K // group_size]
    offsets: torch.Tensor | None  # float32 [N, K // group_size]; None: zero
    bits: int  # 4, 5, 6, 8 (unsigned integer codes), FP8 (0) or FP4 (1)
    group_size: int
    in_features: int
    out_features: int
    input_perm: torch.Tensor | None = None  # int64 [K]

    def __post_init__(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.bits not in INT_BITS + (FP8, FP4):
            raise ValueError(f"bits must be one of {INT_BITS}, 0 (fp8) or 1 (fp4), got {self.bits}")
        if self.bits == FP4 and self.offsets is not None:
            raise ValueError("fp4 weights have no offsets")
        if g <= 0 or k % g:
            raise ValueError(f"in_features {k} is not a multiple of group_size {g}")
        code_shape = (n, k // 2) if self.bits in PACKED else (n, k)
        code_dtype = torch.float8_e4m3fn if self.bits == FP8 else torch.uint8
        if tuple(self.codes.shape) != code_shape or self.codes.dtype != code_dtype:
            raise ValueError(f"codes must be {code_dtype} {code_shape}, got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != (n, k // g) or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {(n, k // g)}, got {t.dtype} {tuple(t.shape)}")
        if self.input_perm is not None and tuple(self.input_perm.shape) != (k,):
            raise ValueError(f"input_perm must have {k} entries, got {tuple(self.input_perm.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: codes, scales, offsets."""
        parts = [self.codes, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def unpacked_codes(self) -> torch.Tensor:
        """float32 [N, K] code values, in the codes' column order."""
        if self.bits in PACKED:
            low, high = self.codes & 0xF, self.codes >> 4
            nibbles = torch.stack([low, high], dim=-1).reshape(self.out_features, self.in_features)
            if self.bits == FP4:
                return torch.tensor(E2M1, device=nibbles.device)[nibbles.long()]
            return nibbles.float()
        return self.codes.float()

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], the layer's weight in its own column order."""
        g = self.group_size
        w = self.unpacked_codes() * self.scales.repeat_interleave(g, dim=1)
        if self.offsets is not None:
            w = w + self.offsets.repeat_interleave(g, dim=1)
        if self.input_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_perm, w)
        return w


def quantized_linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None):
    """x [M, K] @ dequantize(qw).T (+ bias), in float32, returned in x's dtype: the
    reference every kernel is tested against."""
    y = x.float() @ qw.dequantize().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
