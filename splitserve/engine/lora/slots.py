"""A fixed number of adapter slots on the model's device, swapped least-recently-used.

Each LoRA-capable projection gets two stacked buffers, the same shape whatever adapters
are resident: A [max_loras, parts * max_rank, in] and B [max_loras, out, parts * max_rank].
A part (q of qkv, up of gate_up) occupies its own `max_rank` columns of B at its rows, so a
fused projection's delta is one shrink and one expand whose B is block-diagonal; unused
ranks and modules an adapter does not adapt stay zero (their delta is exactly 0).
Copying an adapter in is the only per-swap cost: the weights were read and checked when
the adapter was loaded (adapter.py), not here.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

import torch
from torch import nn

from splitserve.engine.lora.adapter import PARTS, LoRAAdapter


class LoRASlots:
    def __init__(self, targets: dict[str, nn.Module], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for name, linear in targets.items():
            width = PARTS[name.split(".", 2)[-1]] * max_rank
            self.a[name] = torch.zeros(max_loras, width, linear.in_features, dtype=dtype, device=device)
            self.b[name] = torch.zeros(max_loras, linear.out_features, width, dtype=dtype, device=device)
        self.resident: OrderedDict[tuple[str, int], int] = OrderedDict()  # adapter key -> slot, LRU first
        self.num_loads = 0
        self.loads: Counter[tuple[str, int]] = Counter()  # swaps in, per adapter (metrics)

    def assign(self, adapters: list[LoRAAdapter]) -> dict[tuple[str, int], int]:
        """A slot for each of `adapters` (at most max_loras distinct), loading the ones not
        resident into the slots least recently used by any step."""
        wanted = {a.key: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters, more than the {self.max_loras} slots "
                               "(the scheduler admits at most --max-loras adapters at once)")
        for key in wanted:
            if key in self.resident:
                self.resident.move_to_end(key)
        for key, adapter in wanted.items():
            if key not in self.resident:
                self._load(adapter, self._free_slot(set(wanted)))
        return {key: self.resident[key] for key in wanted}

    def place(self, adapter: LoRAAdapter, slot: int) -> None:
        """`adapter` in `slot`, as rank 0's `assign` decided (a tensor-parallel rank's side:
        lora/ranks.py); copied in unless it is there already."""
        if self.resident.get(adapter.key) == slot:
            return
        for key in [k for k, s in self.resident.items() if s == slot or k == adapter.key]:
            del self.resident[key]
        self._load(adapter, slot)

    def evict(self, key: tuple[str, int]) -> None:
        """Forget an unloaded adapter's slot (its weights are overwritten on the next load)."""
        self.resident.pop(key, None)

    def _free_slot(self, keep: set) -> int:
        used = set(self.resident.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(k for k in self.resident if k not in keep)  # least recently used first
        return self.resident.pop(victim)

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        for name in self.a:
            self.a[name][slot].zero_()
            self.b[name][slot].zero_()
            for part in adapter.modules.get(name, []):
                cols = slice(part.position * self.max_rank, part.position * self.max_rank + adapter.rank)
                self.a[name][slot, cols].copy_(part.a, non_blocking=True)
                self.b[name][slot, part.rows[0]:part.rows[1], cols].copy_(part.b, non_blocking=True)
        self.resident[adapter.key] = slot
        self.num_loads += 1
        self.loads[adapter.key] += 1
