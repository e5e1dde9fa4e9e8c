"""The recurrent-state pool of a hybrid model (Qwen3-Next's Gated DeltaNet layers): a fixed-size
state per running sequence instead of a growing KV, in slots.

A slot holds, for every recurrent layer, the convolution window (the last kernel - 1 inputs of
the causal conv, in the model's dtype) and the delta-rule state [v_heads, k_dim, v_dim] (float32,
as transformers keeps it). The KV cache manager (engine/block_manager.py) owns which sequence
holds which slot: it takes one at admission and gives it back when the sequence finishes, is
aborted or is preempted; the pool here is only the tensors, written by the layers in the step.
A preempted sequence recomputes from position 0, so its state is rebuilt from zeros (a layer
reads no slot at a sequence's start: models/gated_delta_net.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.core.model_config import ModelConfig


@dataclass(frozen=True)
class RecurrentStateSpec:
    num_layers: int  # recurrent layers
    conv_dim: int
    conv_width: int  # kernel - 1
    v_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype) -> RecurrentStateSpec:
        r = cfg.raw
        k_heads, v_heads = int(r["linear_num_key_heads"]), int(r["linear_num_value_heads"])
        dk, dv = int(r["linear_key_head_dim"]), int(r["linear_value_head_dim"])
        return cls(len(cfg.linear_layers), 2 * k_heads * dk + v_heads * dv, int(r["linear_conv_kernel_dim"]) - 1,
                   v_heads, dk, dv, dtype)

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one sequence's state over all recurrent layers."""
        conv = self.conv_dim * self.conv_width * torch.empty(0, dtype=self.dtype).element_size()
        return self.num_layers * (conv + self.v_heads * self.k_dim * self.v_dim * 4)


class RecurrentStatePool:
    def __init__(self, spec: RecurrentStateSpec, num_slots: int, device: torch.device):
        self.spec, self.num_slots = spec, num_slots
        self.conv = torch.zeros(spec.num_layers, num_slots, spec.conv_dim, spec.conv_width, dtype=spec.dtype,
                                device=device)
        self.ssm = torch.zeros(spec.num_layers, num_slots, spec.v_heads, spec.k_dim, spec.v_dim,
                               dtype=torch.float32, device=device)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows [slots, conv_dim, kernel - 1], delta states [slots, v_heads, dk, dv])."""
        return self.conv[index], self.ssm[index]


@dataclass
class RecurrentStep:
    """One step's sequences as the recurrent layers see them, in the step's token order
    (prefill chunks first, then decodes)."""

    pool: RecurrentStatePool
    slots: list[int]
    starts: list[int]  # the sequence's computed tokens before this step (0: start from zeros)
    offsets: list[int]  # token offsets: sequence i's tokens are offsets[i]:offsets[i + 1]
    num_prefills: int
    slot_tensor: torch.Tensor
    fresh_tensor: torch.Tensor  # bool: starts == 0

    @classmethod
    def build(cls, pool: RecurrentStatePool, slots: list[int], starts: list[int], lens: list[int],
              num_prefills: int) -> RecurrentStep:
        if any(s < 0 for s in slots):
            raise AssertionError("a sequence of a hybrid model was scheduled without a state slot")
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        device = pool.ssm.device
        return cls(pool, slots, starts, offsets, num_prefills, torch.tensor(slots, dtype=torch.int64, device=device),
                   torch.tensor([s == 0 for s in starts], dtype=torch.bool, device=device))
