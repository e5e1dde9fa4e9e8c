"""A LoRA adapter under tensor parallelism: each rank keeps the part of lora_A / lora_B that
pairs with its part of the base weight, so the adapter's delta is split exactly as the
projection is (docs/architecture.md, "Multi-LoRA").

The base weight's split is the checkpoint loader's (`parallel/sharding.checkpoint_shard`),
so a GQA head split, replicated KV heads and the q/k/v and gate/up parts of our fused
projections follow the base weights by construction:

- column-parallel (q/k/v, gate/up: a rank holds output rows): delta = x A^T B^T, and this
  rank's output rows of it need all of A and only B's same rows. A replicated, B sliced.
- row-parallel (o_proj, down_proj: a rank holds input columns and a partial sum that is
  all-reduced): x A^T = sum over ranks of x_r A_r^T, where x_r and A_r are the rank's
  columns; the rank adds x_r A_r^T B^T to its partial sum and the all-reduce sums the
  ranks' terms into the whole delta. A sliced by the same columns, B replicated.

Pure functions of the module name, the model's shape and (rank, size).
"""

from __future__ import annotations

import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine.parallel.sharding import Shard, checkpoint_shard
from splitserve.engine.parallel.state import TPState


def lora_split(module: str, cfg: ModelConfig, t: TPState) -> tuple[Shard, int] | None:
    """(this rank's part of the base weight of PEFT module `module`, e.g.
    model.layers.3.self_attn.q_proj, and the whole weight's length along the split
    dimension); None when the weight is not split (tp=1)."""
    name = f"{module}.weight"
    shard = checkpoint_shard(name, cfg, t)
    if shard is None:
        return None
    # the last rank holds the last rows (heads, intermediate columns), also when KV heads are replicated
    last = checkpoint_shard(name, cfg, TPState(t.size - 1, t.size))
    return shard, last.start + last.length


def whole_shapes(split: tuple[Shard, int], want_a: tuple[int, int], want_b: tuple[int, int]):
    """The shapes of lora_A [r, in] and lora_B [out, r] in the adapter's file, from the
    shapes this rank's parts must have."""
    shard, whole = split
    if shard.dim == 0:  # column-parallel: B's output rows are split
        return want_a, (whole, want_b[1])
    return (want_a[0], whole), want_b  # row-parallel: A's input columns are split


def rank_parts(split: tuple[Shard, int], a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's lora_A and lora_B (copies: a view would keep the whole tensor alive)."""
    shard, _ = split
    if shard.dim == 0:
        return a, b.narrow(0, shard.start, shard.length).clone()
    return a.narrow(1, shard.start, shard.length).clone(), b
