"""Tokens routed to each expert of each MoE layer, the input an expert-load balancer needs
(metrics.py: splitserve_moe_expert_tokens_total{layer,expert}).

Off the hot path: each MoE block adds its step's expert choices into an int64 tensor on the
device (index_add_: no host sync, and a CUDA graph captures it like the rest of the step);
the host copies all layers' counts in one transfer at most every PUBLISH_INTERVAL_S, when
the engine takes its stats (LLMEngine.stats, after every step), so a GPU engine pays one
small copy a second, not one per step. Rank 0's model alone counts: every rank routes all
of the step's tokens (tensor and expert parallelism alike), so rank 0's counts are the
engine's. A padded decode step (CUDA graphs, async scheduling) counts its padding rows too:
they route like tokens."""

from __future__ import annotations

import time

import torch
from torch import nn

PUBLISH_INTERVAL_S = 1.0

Counts = tuple[tuple[int, tuple[int, ...]], ...]  # (layer, tokens per expert) per MoE layer


class ExpertTokenCounts:
    def __init__(self, model: nn.Module, device: torch.device):
        from splitserve.engine.models.moe import SparseMoeBlock

        self.blocks = [(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", []))
                       if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]
        for _, block in self.blocks:
            block.expert_tokens = torch.zeros(block.gate.weight.shape[0], dtype=torch.int64, device=device)
        self.published: Counts = ()
        self.read_at = float("-inf")

    def snapshot(self, now: float | None = None) -> Counts:
        """The counts so far, as of the last copy (made now if it is PUBLISH_INTERVAL_S old)."""
        now = time.monotonic() if now is None else now
        if self.blocks and now - self.read_at >= PUBLISH_INTERVAL_S:
            self.published, self.read_at = self.read(), now
        return self.published

    def read(self) -> Counts:
        """The counts now: one device-to-host copy of every layer's."""
        if not self.blocks:
            return ()
        counts = torch.stack([block.expert_tokens for _, block in self.blocks]).tolist()
        return tuple((layer, tuple(c)) for (layer, _), c in zip(self.blocks, counts, strict=True))
