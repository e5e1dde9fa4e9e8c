"""The sharded layers. Each is built with this rank's sizes (parallel/sharding.py says
which rows or columns of the checkpoint it holds); at tp=1 each is the plain layer.

- ColumnParallelLinear: output rows split; no communication (its output feeds a per-rank
  computation: attention over this rank's heads, the activation of this rank's MLP slice).
- RowParallelLinear: input columns split; each rank computes a partial sum, all-reduced.
  The bias is added by rank 0 alone, before the reduction, so it counts once.
- VocabParallelEmbedding: vocabulary rows split; a rank looks up the ids it holds, zeros the
  rest, and the all-reduce assembles the embeddings.
- ParallelLMHead: vocabulary rows split; the logits are all-gathered (every rank gets all).

A quantized checkpoint swaps a linear for a QuantizedLinear (models/quant_linear.py);
`quantized_replacement` keeps the reduction or the gather that the layer had."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.models.quant_linear import QuantizedLinear
from splitserve.engine.parallel.sharding import vocab_rows
from splitserve.engine.parallel.state import all_gather, all_reduce, tp
from splitserve.kernels import ops


class ColumnParallelLinear(nn.Linear):
    """nn.Linear over this rank's output rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    # LoRA's term of this rank's input columns (lora/apply.py): added to the partial sum
    # before the all-reduce, which sums the ranks' terms (a forward hook would run after it)
    before_reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return ops.linear(x, self.weight, self.bias)
        out = ops.linear(x, self.weight, self.bias if tp().rank == 0 else None)
        return all_reduce(out if self.before_reduce is None else self.before_reduce(x, out))


class ParallelLMHead(nn.Linear):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_rows(vocab_size, tp())[2], bias=False)
        self.vocab_size = vocab_size
        self.packed_weight: torch.Tensor | None = None  # a tied head's oneDNN copy (models/loader.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        several_rows = self.packed_weight is not None and x.numel() > x.shape[-1]
        weight = self.packed_weight if several_rows else self.weight
        return all_gather(ops.linear(x, weight))[..., :self.vocab_size]  # padding rows dropped


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        self.vocab_start, _, padded = vocab_rows(vocab_size, tp())
        # An explicit (meta) weight: nn.Embedding would otherwise fill a fresh one with normal_(),
        # which on the meta device the loader builds on goes through torch._refs and imports
        # torch._dynamo: 1-2 s of CPU in every engine process, for values the checkpoint overwrites.
        super().__init__(padded, hidden_size, _weight=torch.empty(padded, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class RowParallelQuantizedLinear(QuantizedLinear):
    before_reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # as RowParallelLinear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp().size == 1:
            return super().forward(x)
        bias, self.bias = self.bias, (self.bias if tp().rank == 0 else None)
        try:
            out = super().forward(x)
        finally:
            self.bias = bias
        return all_reduce(out if self.before_reduce is None else self.before_reduce(x, out))


class GatheredQuantizedLinear(QuantizedLinear):
    vocab_size: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather(super().forward(x))[..., :self.vocab_size]


def quantized_replacement(linear: nn.Module) -> QuantizedLinear:
    """The QuantizedLinear that takes `linear`'s place, with its communication."""
    if isinstance(linear, RowParallelLinear):
        return RowParallelQuantizedLinear.replacing(linear)
    if isinstance(linear, ParallelLMHead):
        head = GatheredQuantizedLinear.replacing(linear)
        head.vocab_size = linear.vocab_size
        return head
    return QuantizedLinear.replacing(linear)
