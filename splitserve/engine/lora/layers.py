"""A model's LoRA slots and the hooks that add their deltas, made once per model.

The model runner makes them when the engine starts with LoRA on, before it captures its
decode graphs, so that every captured graph holds the projections' deltas (engine/cuda_graphs.py);
the adapter manager of rank 0 (manager.py) and of each other tensor-parallel rank (ranks.py)
then take the same objects: one set of slots, one per-step state, one hook per projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.engine.lora.adapter import lora_targets
from splitserve.engine.lora.apply import NO_ADAPTER, LoRAStep, install_hooks
from splitserve.engine.lora.slots import LoRASlots


@dataclass
class LoRALayers:
    slots: LoRASlots
    step: LoRAStep

    def slot_of(self, seq) -> int:
        """The slot `seq`'s adapter holds (NO_ADAPTER: the base model); the step's adapters
        were put in slots before the step is staged (LoRAManager.prepare)."""
        return NO_ADAPTER if seq.lora is None else self.slots.resident[seq.lora.key]


def lora_layers(model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> LoRALayers:
    """`model`'s LoRA slots and hooks: installed on the first call, the same objects after."""
    made = getattr(model, "lora_layers", None)
    if made is None:
        targets = lora_targets(model)
        made = LoRALayers(LoRASlots(targets, max_loras, max_rank, dtype, device), LoRAStep())
        install_hooks(targets, made.slots.a, made.slots.b, made.step)
        model.lora_layers = made
    elif (made.slots.max_loras, made.slots.max_rank) != (max_loras, max_rank):
        raise ValueError(f"the model's LoRA slots were made for max_loras={made.slots.max_loras} and "
                         f"max_lora_rank={made.slots.max_rank}, not {max_loras} and {max_rank}")
    return made
