"""The batched LoRA matmul in torch (the reference the Triton kernel is tested against,
and the CPU path).

A step's tokens belong to different adapters. `perm` lists the adapted tokens grouped by
slot; segment s is perm[seg_starts[s]:seg_starts[s+1]], all under slot seg_slots[s]
(tokens of the base model are in no segment). `sgmv` (segmented gathered matrix-vector,
Punica's name) computes, for every segment, out[rows] (+)= x[rows] @ w[slot].T: one matmul
per segment, never a Python loop over tokens.
"""

from __future__ import annotations

import torch


def sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, perm: torch.Tensor,
         seg_starts: list[int], seg_slots: list[int], accumulate: bool) -> torch.Tensor:
    """x [n, k], w [slots, m, k], out [n, m]: the rows in segments are written (or added to)."""
    rows = x.index_select(0, perm)
    parts = [rows[a:b] @ w[slot].T for a, b, slot in zip(seg_starts, seg_starts[1:], seg_slots, strict=False)]
    result = torch.cat(parts).to(out.dtype)
    if accumulate:
        out.index_add_(0, perm, result)
    else:
        out.index_copy_(0, perm, result)
    return out


def lora_delta_padded(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                      first_slot: int) -> torch.Tensor:
    """The same delta for steps of short segments (decode): `rows` [slots, L] lists each slot's
    tokens from `first_slot` on, padded with x.shape[0] (a zero row); two batched matmuls over
    the slots' stacked weights (views, no copy) replace two matmuls per segment, so a decode
    step's cost does not grow with the number of distinct adapters in it."""
    n, count = x.shape[0], rows.shape[0]
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, rows.flatten()).view(count, -1, x.shape[1])
    delta = torch.bmm(torch.bmm(padded, a[first_slot:first_slot + count].transpose(1, 2)),
                      b[first_slot:first_slot + count].transpose(1, 2))
    summed = out.new_zeros(n + 1, out.shape[1]).index_add_(0, rows.flatten(), delta.flatten(0, 1).to(out.dtype))
    return out.add_(summed[:n])


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, perm: torch.Tensor,
               seg_starts: list[int], seg_slots: list[int]) -> torch.Tensor:
    """out[rows] += (x[rows] @ a[slot].T) @ b[slot].T per segment: shrink and expand fused
    per segment (the CPU path: one gather, two small matmuls a segment, one scatter-add)."""
    rows = x.index_select(0, perm)
    parts = [(rows[s:e] @ a[slot].T) @ b[slot].T
             for s, e, slot in zip(seg_starts, seg_starts[1:], seg_slots, strict=False)]
    return out.index_add_(0, perm, torch.cat(parts).to(out.dtype))


def lora_delta_by_row(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                      row_slots: torch.Tensor) -> torch.Tensor:
    """out[i] += (x[i] @ a[s].T) @ b[s].T with s = row_slots[i], for every row whose slot is
    >= 0 (Punica's BGMV: each row gathers its own slot of the stacked weights). Its shapes
    depend only on x and the stacks, never on which rows share an adapter, so a CUDA graph
    can hold it (the padded decode step, lora/apply.py); rows with slot -1 add exactly 0."""
    live = (row_slots >= 0).to(out.dtype).unsqueeze(1)
    slot = row_slots.clamp_min(0)
    h = torch.bmm(x.unsqueeze(1), a.index_select(0, slot).transpose(1, 2))  # [n, 1, rank columns]
    delta = torch.bmm(h, b.index_select(0, slot).transpose(1, 2)).squeeze(1)
    return out.add_(delta.to(out.dtype) * live)
