"""The engine's LoRA state: the loaded adapters by name, their slots, and the per-step work.

- Loading reads and checks an adapter once (adapter.py); requests then name it.
- The scheduler admits a request only while the live sequences use at most --max-loras
  distinct adapters, so every step's adapters fit the slots (slots.py).
- Before each forward pass, `prepare` gives the step's adapters slots and tells the
  projections' hooks which tokens run under which slot (apply.py).
- Under tensor parallelism the other ranks load every adapter too, all or none, and
  follow each step's slots (ranks.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from splitserve.core.lora_names import lora_name_problem
from splitserve.engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from splitserve.engine.lora.layers import lora_layers
from splitserve.engine.lora.ranks import LoRARanks, LoRAStepPlan
from splitserve.engine.parallel.state import tp


class UnknownLoRAError(LoRAAdapterError):
    """A request named an adapter that is not loaded."""


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} and {max_rank}")
        self.model, self.max_rank, self.device = model, max_rank, device
        self.adapters: dict[str, LoRAAdapter] = {}
        layers = lora_layers(model, max_loras, max_rank, dtype, device)  # (the runner's, when it made them)
        self.slots, self.step = layers.slots, layers.step
        self.requests: Counter[str] = Counter()  # requests run per adapter (metrics)
        self.ranks = LoRARanks() if tp().size > 1 else None  # the other tensor-parallel ranks

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Load an adapter under `name` (raises LoRAAdapterError; nothing changes then).
        Loading the same name again is a no-op if the content is the same."""
        problem = lora_name_problem(name)
        if problem:
            raise LoRAAdapterError(problem)
        adapter = load_adapter(name, path, self.model, self.max_rank)
        old = self.adapters.get(name)
        if old is not None and old.salt != adapter.salt:
            raise LoRAAdapterError(f"LoRA adapter {name!r} is already loaded with other weights; unload it first")
        if old is not None:
            return old  # (the other ranks hold it already)
        if self.device.type == "cuda":
            adapter.pin()
        if self.ranks is not None:  # every other rank reads its part: kept on all ranks, or on none
            problem = self.ranks.load(name, path, adapter.salt)
            if problem is not None:
                raise LoRAAdapterError(problem)
            self.ranks.watch(adapter)
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> bool:
        """Unload: new requests can no longer name it (running ones finish under it)."""
        return self.adapters.pop(name, None) is not None

    def resolve(self, name: str | None) -> LoRAAdapter | None:
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise UnknownLoRAError(f"The model `{name}` does not exist.")
        return adapter

    def admits(self, lora: LoRAAdapter | None, live: Iterable) -> bool:
        """May a sequence under `lora` join the `live` sequences without needing more slots?"""
        if lora is None:
            return True
        keys = {s.lora.key for s in live if s.lora is not None}
        return lora.key in keys or len(keys) < self.max_loras

    def holds_slot(self, lora: LoRAAdapter | None) -> bool:
        """Is `lora` (None: the base model) in a slot now? A step of such sequences only loads
        nothing: the overlapped decode (engine/overlap.py) runs no step that swaps an adapter in."""
        return lora is None or lora.key in self.slots.resident

    def prepare(self, entries: list) -> LoRAStepPlan | None:
        """Before a step over `entries` [(sequence, new tokens)], in the step's token order;
        under tensor parallelism, the plan the step's inputs carry to the other ranks."""
        adapters = [seq.lora for seq, _ in entries if seq.lora is not None]
        slot_of = self.slots.assign(adapters) if adapters else {}
        token_slots: list[int] = []
        for seq, n in entries:
            token_slots.extend([slot_of[seq.lora.key] if seq.lora is not None else -1] * n)
        self.step.set(token_slots, self.device)
        return self.ranks.plan(entries, slot_of) if self.ranks is not None else None

    def rank_adapters(self) -> list[list[str]]:
        """The adapter names each other tensor-parallel rank holds weights of (1..N-1);
        [] at tp=1. A broadcast: call it between steps."""
        return self.ranks.held() if self.ranks is not None else []

    def resident(self) -> list[str]:
        """Names of the loaded adapters that hold a slot now (load reports, routing)."""
        return [name for name, a in self.adapters.items() if a.key in self.slots.resident]
