"""QuantizedLinear: the nn.Linear of a layer whose weight is quantized (issue 31).

Our fused projections (qkv_proj from q/k/v, gate_up_proj from gate/up) are filled part by
part, and a checkpoint may quantize the parts differently (a GGUF file mixes Q4_K and
Q6_K; a partly quantized checkpoint mixes float and quantized). So the weight is a list
of row ranges, each its own QuantizedWeight (or float tensor). At load end, adjacent parts
of one format (bits, group size, input permutation) are concatenated along the output
rows: in the common case the layer is one quantized matmul, like the float one.
The bias (Qwen2's q/k/v bias) stays a float parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels import ops
from splitserve.kernels.fp8_scaled_mm import Fp8RowwiseWeight, fp8_linear, rowwise
from splitserve.kernels.quant_weight import FP4, FP8, QuantizedWeight

Part = QuantizedWeight | torch.Tensor


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rows: list[tuple[int, int]] = []  # each part's row range; after finish(), in order
        self.parts: list[Part] = []
        self.bias = bias
        self.fp8_rowwise: dict[int, Fp8RowwiseWeight] = {}  # part index -> W8A8 form (use_fp8_activations)
        self.fp8_min_rows = 1  # matmuls of fewer rows keep the weight-only kernel

    @classmethod
    def replacing(cls, linear: nn.Module) -> QuantizedLinear:
        return cls(linear.in_features, linear.out_features, linear.bias)

    def set_part(self, index: slice | None, weight: Part) -> None:
        """Rows `index` (None: all) of the weight; ValueError if they overlap rows already set."""
        start, stop = (0, self.out_features) if index is None else (index.start, index.stop)
        shape = (weight.out_features, weight.in_features) if isinstance(weight, QuantizedWeight) \
            else tuple(weight.shape)
        if shape != (stop - start, self.in_features) or not 0 <= start < stop <= self.out_features:
            raise ValueError(f"a weight of shape {shape} cannot be rows {start}:{stop} of this "
                             f"{self.out_features}x{self.in_features} layer (check config.json's sizes)")
        if any(start < b and a < stop for a, b in self.rows):
            raise ValueError(f"rows {start}:{stop} filled a second time")
        self.rows.append((start, stop))
        self.parts.append(weight)

    def missing_rows(self) -> int:
        return self.out_features - sum(b - a for a, b in self.rows)

    def finish(self) -> None:
        """Order the parts by row and merge adjacent ones that one matmul can compute."""
        order = sorted(range(len(self.rows)), key=lambda i: self.rows[i])
        rows, parts = [self.rows[order[0]]], [self.parts[order[0]]]
        for i in order[1:]:
            if mergeable(parts[-1], self.parts[i]):
                parts[-1] = concat_rows(parts[-1], self.parts[i])
                rows[-1] = (rows[-1][0], self.rows[i][1])
            else:
                rows.append(self.rows[i])
                parts.append(self.parts[i])
        self.rows, self.parts = rows, parts

    def use_fp8_activations(self, min_rows: int = 1) -> int:
        """FP8 parts with a scale per row multiply FP8 activations from now on
        (kernels/fp8_scaled_mm.py) in matmuls of at least `min_rows` rows; returns how many parts do."""
        self.fp8_rowwise = {i: w for i, part in enumerate(self.parts)
                            if isinstance(part, QuantizedWeight) and (w := rowwise(part)) is not None}
        self.fp8_min_rows = min_rows
        return len(self.fp8_rowwise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for i, ((start, stop), part) in enumerate(zip(self.rows, self.parts, strict=True)):
            bias = None if self.bias is None else self.bias[start:stop]
            if i in self.fp8_rowwise and x.numel() >= self.fp8_min_rows * self.in_features:
                outs.append(fp8_linear(x, self.fp8_rowwise[i], bias))
            elif isinstance(part, QuantizedWeight):
                outs.append(ops.quantized_linear(x, part, bias))
            else:
                outs.append(F.linear(x, part, bias))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def extra_repr(self) -> str:
        names = {FP8: "fp8", FP4: "fp4"}
        kinds = [f"{names.get(p.bits, f'{p.bits}-bit')}/g{p.group_size}" if isinstance(p, QuantizedWeight)
                 else str(p.dtype) for p in self.parts]
        return f"in={self.in_features}, out={self.out_features}, parts={kinds}, bias={self.bias is not None}"


def mergeable(a: Part, b: Part) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
    same_perm = (a.input_perm is None and b.input_perm is None) or (
        a.input_perm is not None and b.input_perm is not None and torch.equal(a.input_perm, b.input_perm))
    return (a.bits, a.group_size, a.in_features, a.codes.dtype, a.offsets is None) == \
        (b.bits, b.group_size, b.in_features, b.codes.dtype, b.offsets is None) and same_perm


def concat_rows(a: Part, b: Part) -> Part:
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])
    return QuantizedWeight(codes=torch.cat([a.codes, b.codes]), scales=torch.cat([a.scales, b.scales]),
                           offsets=None if a.offsets is None else torch.cat([a.offsets, b.offsets]),
                           bits=a.bits, group_size=a.group_size, in_features=a.in_features,
                           out_features=a.out_features + b.out_features, input_perm=a.input_perm)


def move_weight(part: Part, device, dtype: torch.dtype) -> Part:
    """A part on the model's device: float parts in the model dtype; a QuantizedWeight's
    codes, scales and offsets as they are (they are the format)."""
    if isinstance(part, torch.Tensor):
        return part.to(device=device, dtype=dtype)
    return QuantizedWeight(codes=part.codes.to(device), scales=part.scales.to(device),
                           offsets=None if part.offsets is None else part.offsets.to(device), bits=part.bits,
                           group_size=part.group_size, in_features=part.in_features,
                           out_features=part.out_features,
                           input_perm=None if part.input_perm is None else part.input_perm.to(device))
