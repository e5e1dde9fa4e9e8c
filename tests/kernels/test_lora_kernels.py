"""The batched LoRA matmul: the torch path (kernels/lora_reference.py) against a float64
loop over tokens, and the Triton segmented gathered matmul (kernels/triton_lora.py;
interpreter here, GPU elsewhere) against the torch path: shrink, expand-and-add, and the
fused delta, over segments longer than a tile, base-model tokens in no segment, slots out
of order, widths that are not multiples of a tile."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.kernels import lora_reference, triton_lora

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def make_step(tokens: int, slots: int, seed: int = 0):
    """Each token's slot (-1: base), and (perm, seg_starts, seg_slots) grouped by slot."""
    rng = random.Random(seed)
    token_slots = [rng.choice([-1, *range(slots)]) for _ in range(tokens)]
    token_slots[:20] = [slots - 1] * 20  # one segment longer than a 16-row tile
    order = sorted((s, i) for i, s in enumerate(token_slots) if s >= 0)
    seg_slots = sorted({s for s, _ in order})
    starts = [0]
    for slot in seg_slots:
        starts.append(starts[-1] + sum(1 for s, _ in order if s == slot))
    return token_slots, torch.tensor([i for _, i in order]), starts, seg_slots


def loop_reference(x, a, b, token_slots):
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for i, slot in enumerate(token_slots):
        if slot >= 0:
            out[i] = (x[i].double() @ a[slot].double().T) @ b[slot].double().T
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_path_matches_a_loop_over_tokens(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 72, generator=gen).to(dtype)
    a = (torch.randn(3, 24, 72, generator=gen) / 8).to(dtype)
    b = (torch.randn(3, 40, 24, generator=gen) / 5).to(dtype)
    token_slots, perm, starts, seg_slots = make_step(50, 3)
    base = torch.randn(50, 40, generator=gen).to(dtype)
    out = lora_reference.lora_delta(x, a, b, base.clone(), perm, starts, seg_slots)
    want = base.double() + loop_reference(x, a, b, token_slots)
    assert (out.double() - want).abs().max() < TOLERANCE[dtype] * want.abs().max()
    untouched = [i for i, s in enumerate(token_slots) if s < 0]
    assert torch.equal(out[untouched], base[untouched])  # base-model tokens: exactly the base output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,k,n", [(50, 72, 40), (7, 128, 96), (33, 24, 130)])
def test_triton_sgmv_matches_the_torch_path(device, dtype, tokens, k, n):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(4, n, k, generator=gen) / k**0.5).to(dtype).to(device)
    _, perm, starts, seg_slots = make_step(max(tokens, 20), 4, seed=tokens)
    keep = perm < tokens
    perm = perm[keep]
    counts = [int(keep[a:b].sum()) for a, b in zip(starts, starts[1:], strict=False)]
    seg_slots = [s for s, c in zip(seg_slots, counts, strict=True) if c]
    starts = [0]
    for c in (c for c in counts if c):
        starts.append(starts[-1] + c)
    perm = perm.to(device)
    for accumulate in (False, True):
        base = torch.randn(tokens, n, generator=gen).to(dtype).to(device)
        got = triton_lora.sgmv(x, w, base.clone(), perm, starts, seg_slots, accumulate)
        want = lora_reference.sgmv(x, w, base.clone(), perm, starts, seg_slots, accumulate)
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= TOLERANCE[dtype] * scale, accumulate


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_lora_delta_matches_the_torch_path(device, dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(50, 72, generator=gen).to(dtype).to(device)
    a = (torch.randn(3, 24, 72, generator=gen) / 8).to(dtype).to(device)
    b = (torch.randn(3, 40, 24, generator=gen) / 5).to(dtype).to(device)
    _, perm, starts, seg_slots = make_step(50, 3, seed=3)
    base = torch.randn(50, 40, generator=gen).to(dtype).to(device)
    got = triton_lora.lora_delta(x, a, b, base.clone(), perm.to(device), starts, seg_slots)
    want = lora_reference.lora_delta(x, a, b, base.clone(), perm.to(device), starts, seg_slots)
    assert (got.float() - want.float()).abs().max() <= TOLERANCE[dtype] * want.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_decode_path_matches_a_loop_over_tokens(dtype):
    """The engine's path for steps of short segments: slots 1..3 of 5 in use, slot 2 unused
    (an all-padding row), base-model tokens in no row."""
    from splitserve.engine.lora.apply import LoRAStep

    gen = torch.Generator().manual_seed(4)
    token_slots = [1, -1, 3, 3, 1, -1, 1, 3]
    x = torch.randn(8, 72, generator=gen).to(dtype)
    a = (torch.randn(5, 24, 72, generator=gen) / 8).to(dtype)
    b = (torch.randn(5, 40, 24, generator=gen) / 5).to(dtype)
    step = LoRAStep()
    step.set(token_slots, torch.device("cpu"))
    assert step.first_slot == 1 and step.padded_rows.tolist() == [[0, 4, 6], [8, 8, 8], [2, 3, 7]]
    base = torch.randn(8, 40, generator=gen).to(dtype)
    out = lora_reference.lora_delta_padded(x, a, b, base.clone(), step.padded_rows, step.first_slot)
    want = base.double() + loop_reference(x, a, b, token_slots)
    assert (out.double() - want).abs().max() < TOLERANCE[dtype] * want.abs().max()
    assert torch.equal(out[[1, 5]], base[[1, 5]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_gathered_by_row_slot_matches_a_loop_over_tokens(device, dtype):
    """The padded (CUDA-graph) step's form: each row gathers its own slot (Punica's BGMV),
    -1 rows (base model, padding) add exactly nothing; torch path and Triton kernel, whose
    shapes depend only on the rows, never on which rows share a slot."""
    gen = torch.Generator().manual_seed(5)
    token_slots = [2, -1, 0, 2, 2, -1, 1, 0, -1, 2, 1, 1, 0, -1, 2, 2, 0, 1, -1]  # 19: not a tile multiple
    x = torch.randn(len(token_slots), 72, generator=gen).to(dtype)
    a = (torch.randn(3, 24, 72, generator=gen) / 8).to(dtype)
    b = (torch.randn(3, 130, 24, generator=gen) / 5).to(dtype)
    base = torch.randn(len(token_slots), 130, generator=gen).to(dtype)
    want = base.double() + loop_reference(x, a, b, token_slots)
    slots = torch.tensor(token_slots)
    base_rows = [i for i, s in enumerate(token_slots) if s < 0]
    for delta in (lora_reference.lora_delta_by_row, triton_lora.lora_delta_by_row):
        out = delta(*(t.to(device) for t in (x, a, b, base.clone(), slots))).cpu()
        assert (out.double() - want).abs().max() < TOLERANCE[dtype] * want.abs().max(), delta.__module__
        assert torch.equal(out[base_rows], base[base_rows]), delta.__module__
