"""Adding the adapters' deltas to the projections' outputs during a forward pass.

Before each step the manager fills `LoRAStep` with the step's tokens grouped by slot
(the layout kernels/lora_reference.py describes); a forward hook on every LoRA-capable
projection adds scale * B(A(x)) of each token's adapter to the projection's output. Base
model tokens are in no segment and pay nothing; a step with no adapted token skips the
hooks' work entirely. Under tensor parallelism a row-parallel projection (o_proj,
down_proj) adds the delta of its rank's input columns to its partial sum instead, before
the all-reduce (parallel/linear.py `before_reduce`; lora/sharding.py says why it is exact).

The padded decode step (engine/cuda_graphs.py, replayed from a CUDA graph) cannot use the
grouping: a graph would freeze one step's segments. There `row_slots` is set, a device
tensor of each row's slot (NO_ADAPTER for base-model and padding rows) that the step's
static input holds and every step rewrites, and the delta is gathered by slot row by row
(Punica's BGMV: `lora_delta_by_row`), whose shapes depend only on the bucket. Eager steps
keep the grouped path: it does no work for base-model tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from splitserve.engine.parallel.state import tp
from splitserve.kernels import lora_reference
from splitserve.kernels.ops import backend_for

# Segments of at most this many tokens (decode steps, short chunks) take the padded batched
# path: its padding costs less than one matmul call per segment would.
PADDED_MAX_ROWS = 16
NO_ADAPTER = -1  # a row's slot when it runs the base model (and a padding row's)


@dataclass
class LoRAStep:
    perm: torch.Tensor | None = None  # adapted tokens, grouped by slot (None: no adapted token this step)
    seg_starts: list[int] = field(default_factory=list)
    seg_slots: list[int] = field(default_factory=list)
    whole_slot: int | None = None  # every token of the step under this one slot: no gather needed
    padded_rows: torch.Tensor | None = None  # short segments (decode): [slots, L] for the batched path
    first_slot: int = 0
    grouping: tuple[int, ...] | None = None  # the token_slots these fields were built for
    # the padded (graph) step: [rows] int64 on the device, each row's slot (NO_ADAPTER: none);
    # set by cuda_graphs.DecodeGraphs around its forward pass, None otherwise
    row_slots: torch.Tensor | None = None

    def set(self, token_slots: list[int], device: torch.device) -> None:
        """token_slots: each token's slot in step order, -1 for the base model. The same
        grouping as the last step's (decode steps of the same sequences) is kept as it is:
        nothing is rebuilt or copied, so an overlapped step never waits on the one in flight."""
        grouping = tuple(token_slots)
        if grouping == self.grouping:
            return
        self.grouping = grouping
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(i)
        self.seg_slots = sorted(by_slot)
        self.seg_starts, perm = [0], []
        for slot in self.seg_slots:
            perm.extend(by_slot[slot])
            self.seg_starts.append(len(perm))
        self.perm = _on(device, perm) if perm else None
        self.whole_slot = self.seg_slots[0] if len(self.seg_slots) == 1 and len(perm) == len(token_slots) else None
        self.padded_rows = None
        longest = max((len(rows) for rows in by_slot.values()), default=0)
        if len(self.seg_slots) > 1 and longest <= PADDED_MAX_ROWS:
            self.first_slot = self.seg_slots[0]
            width = self.seg_slots[-1] - self.first_slot + 1
            pad = len(token_slots)  # the zero row appended to x
            table = [by_slot.get(self.first_slot + s, []) for s in range(width)]
            self.padded_rows = _on(device, [r + [pad] * (longest - len(r)) for r in table])


def _on(device: torch.device, rows: list) -> torch.Tensor:
    """An int64 tensor on `device`, copied from pinned memory without waiting: a plain copy
    would wait for the step in flight (async scheduling builds the next step meanwhile)."""
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _lora_delta(x, a, b, out, step: LoRAStep):
    if step.row_slots is not None:  # the padded step: gathered by each row's slot, no grouping
        if backend_for(x) == "triton":
            from splitserve.kernels import triton_lora

            return triton_lora.lora_delta_by_row(x, a, b, out, step.row_slots)
        return lora_reference.lora_delta_by_row(x, a, b, out, step.row_slots)
    if backend_for(x) == "triton":
        from splitserve.kernels import triton_lora  # lazily: Triton is heavy

        return triton_lora.lora_delta(x, a, b, out, step.perm, step.seg_starts, step.seg_slots)
    if step.whole_slot is not None:
        return out.addmm_(x @ a[step.whole_slot].T, b[step.whole_slot].T)  # the add fused into the expand
    if step.padded_rows is not None:
        return lora_reference.lora_delta_padded(x, a, b, out, step.padded_rows, step.first_slot)
    return lora_reference.lora_delta(x, a, b, out, step.perm, step.seg_starts, step.seg_slots)


def install_hooks(targets: dict[str, nn.Module], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                  step: LoRAStep) -> None:
    for name, linear in targets.items():
        def add_delta(x, out, a=a[name], b=b[name]):
            if step.perm is None and step.row_slots is None:
                return out
            return _lora_delta(x.reshape(-1, x.shape[-1]), a, b, out.reshape(-1, out.shape[-1]), step).view_as(out)

        if tp().size > 1 and hasattr(linear, "before_reduce"):
            # row-parallel under TP: this rank's term joins its partial sum, before the all-reduce
            linear.before_reduce = add_delta
        else:
            linear.register_forward_hook(lambda module, inputs, out, add_delta=add_delta: add_delta(inputs[0], out))
