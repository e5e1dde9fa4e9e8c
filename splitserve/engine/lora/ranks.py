"""LoRA over tensor-parallel ranks: every rank holds the same adapters (its parts of them,
lora/sharding.py) in the same slots, and runs each step's tokens under the same slots.

Rank 0 (LoRAManager, with a LoRARanks) decides; ranks 1..N-1 (RankLoRA, in
parallel/worker.py) follow what it broadcasts between steps and with each step:

- a load: rank 0 reads and checks the adapter first (a bad one never reaches the ranks),
  then broadcasts LoadLoRA; every rank reads its parts, and all ranks exchange (error,
  salt). Each reaches the same verdict from the same list (load_verdict): keep it on every
  rank, or on none (one rank's error, or files that changed between two ranks' reads).
  One round, so a load is atomic across ranks.
- a step: its inputs carry a LoRAStepPlan (StepInputs.lora): each entry's slot, the
  adapter each slot used must hold (a rank copies in what it does not hold there), and
  the adapters rank 0 has let go of.
- an unload: rank 0 drops the name at once (no new request can name it); requests running
  under it finish under it, so the ranks keep its weights until rank 0's adapter object is
  gone (no request holds it any more), then forget them with the next step or query.
"""

from __future__ import annotations

import weakref
from collections import Counter, deque
from dataclasses import dataclass

import torch
from torch import nn

from splitserve.engine.lora.adapter import LoRAAdapter, load_adapter
from splitserve.engine.lora.layers import lora_layers
from splitserve.engine.parallel.state import broadcast_object, gather_object

Key = tuple[str, int]  # LoRAAdapter.key: (name, salt)


@dataclass(frozen=True)
class LoadLoRA:
    """Broadcast: read adapter `name` from `path` (every rank then joins the verdict)."""

    name: str
    path: str


@dataclass(frozen=True)
class QueryLoRA:
    """Broadcast: forget `forget`, then say which adapters you hold (tests, diagnostics)."""

    forget: tuple[Key, ...] = ()


@dataclass
class LoRAStepPlan:
    """A step's LoRA work as the other ranks need it (StepInputs.lora)."""

    runs: list[tuple[int, int]]  # (slot, tokens) in the step's token order; slot -1: the base model
    slots: dict[int, Key]  # slot -> the adapter it holds this step
    forget: list[Key]  # adapters rank 0 has let go of since the last step

    def token_slots(self) -> list[int]:
        return [slot for slot, n in self.runs for _ in range(n)]


def plan_step(entries: list, slot_of: dict[Key, int], forget: list[Key]) -> LoRAStepPlan:
    """The plan of a step over `entries` [(sequence, new tokens)] whose adapters took the
    slots `slot_of`. Pure."""
    runs: list[tuple[int, int]] = []
    for seq, n in entries:
        slot = slot_of[seq.lora.key] if seq.lora is not None else -1
        if runs and runs[-1][0] == slot:
            runs[-1] = (slot, runs[-1][1] + n)
        else:
            runs.append((slot, n))
    return LoRAStepPlan(runs, {slot: key for key, slot in slot_of.items()}, forget)


def load_verdict(name: str, results: list[tuple[str | None, int | None]]) -> str | None:
    """Why a load must be undone on every rank, from each rank's (error, salt); None: keep
    it. Pure: every rank computes it from the same list and agrees."""
    for rank, (error, _) in enumerate(results):
        if error is not None:
            return f"{error} (tensor-parallel rank {rank})"
    if len({salt for _, salt in results}) > 1:
        return (f"LoRA adapter {name!r}: its files changed while the tensor-parallel ranks read them "
                "(the ranks would hold different weights); load it again")
    return None


class LoRARanks:
    """Rank 0's side: loads that reach every rank, and each step's plan."""

    def __init__(self):
        self.forgotten: deque[Key] = deque()  # appended by finalizers: from any thread

    def load(self, name: str, path: str, salt: int) -> str | None:
        """Every other rank reads the adapter rank 0 has read (with content `salt`); the
        verdict every rank acts on (None: all keep it)."""
        broadcast_object(LoadLoRA(name, path))
        return load_verdict(name, gather_object((None, salt)))

    def watch(self, adapter: LoRAAdapter) -> None:
        """The ranks forget `adapter`'s weights once this object is gone."""
        weakref.finalize(adapter, self.forgotten.append, adapter.key)

    def plan(self, entries: list, slot_of: dict[Key, int]) -> LoRAStepPlan:
        return plan_step(entries, slot_of, self._drain())

    def held(self) -> list[list[str]]:
        """The adapter names each other rank holds weights of, in rank order (1..N-1)."""
        broadcast_object(QueryLoRA(tuple(self._drain())))
        return gather_object(None)[1:]

    def _drain(self) -> list[Key]:
        out = []
        while self.forgotten:
            out.append(self.forgotten.popleft())
        return out


class RankLoRA:
    """A rank's LoRA state (ranks 1..N-1): slots and hooks on its slice of the model, and
    its parts of the adapters rank 0 has loaded, by key, counted (rank 0 may hold two
    objects of one key: an adapter unloaded, still running, and loaded again)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.model, self.max_rank, self.device = model, max_rank, device
        layers = lora_layers(model, max_loras, max_rank, dtype, device)  # (the runner's, when it made them)
        self.slots, self.step = layers.slots, layers.step
        self.adapters: dict[Key, LoRAAdapter] = {}
        self.refs: Counter[Key] = Counter()

    def handle(self, command: LoadLoRA | QueryLoRA) -> None:
        if isinstance(command, LoadLoRA):
            self._load(command)
        else:
            for key in command.forget:
                self._forget(key)
            gather_object(sorted({name for name, _ in self.adapters}))

    def apply(self, plan: LoRAStepPlan | None) -> None:
        """Before a step: its adapters in their slots, its tokens grouped by slot."""
        if plan is None:
            self.step.set([], self.device)
            return
        for key in plan.forget:
            self._forget(key)
        for slot, key in plan.slots.items():
            self.slots.place(self.adapters[key], slot)
        self.step.set(plan.token_slots(), self.device)

    def _load(self, command: LoadLoRA) -> None:
        adapter = None
        try:
            adapter = load_adapter(command.name, command.path, self.model, self.max_rank)
            if self.device.type == "cuda":
                adapter.pin()
            result = (None, adapter.salt)
        except Exception as exc:  # noqa: BLE001 - any failure here is this rank's verdict, sent to all
            result = (str(exc) or type(exc).__name__, None)
        if load_verdict(command.name, gather_object(result)) is None:
            self.adapters.setdefault(adapter.key, adapter)
            self.refs[adapter.key] += 1

    def _forget(self, key: Key) -> None:
        self.refs[key] -= 1
        if self.refs[key] <= 0:
            del self.refs[key]
            self.adapters.pop(key, None)
            self.slots.evict(key)
