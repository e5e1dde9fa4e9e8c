"""Mixture-of-experts in torch: the router's top-k selection and the experts' SwiGLU MLPs.

`fused_moe` is the oracle for the Triton kernel (splitserve/kernels/triton_moe.py) and
what the engine runs on the CPU. Shapes:
  hidden       : [tokens, hidden]
  w13          : [experts, 2 * intermediate, hidden]  gate rows, then up rows
  w2           : [experts, hidden, intermediate]
  topk_weights : [tokens, top_k]  any float dtype; applied in float32
  topk_ids     : [tokens, top_k]  int32/int64, each in [0, experts) and distinct per token

Numerics: each expert's two projections run in the activation dtype (as transformers
runs them); the routing weight multiplies the expert's output in float32 and the top-k
outputs are summed in float32 in k order, rounded once to the activation dtype at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, then the top-k; `renormalize` rescales the
    k probabilities to sum to 1 (Mixtral always, Qwen3-MoE when `norm_topk_prob`).
    Returns (weights float32 [tokens, top_k], ids int64 [tokens, top_k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check_fused_moe_args(what: str, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Shape and dtype checks shared by both backends. Host-side only: the expert ids'
    values are not read (that would synchronise with the device)."""
    if hidden.dim() != 2:
        raise ValueError(f"{what}: hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    tokens, hidden_size = hidden.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{what}: w13 must be [experts, 2*intermediate, hidden] and w2 [experts, hidden, "
                         f"intermediate], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    experts, intermediate = w2.shape[0], w2.shape[2]
    if w13.shape != (experts, 2 * intermediate, hidden_size) or w2.shape[1] != hidden_size:
        raise ValueError(f"{what}: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden size "
                         f"{hidden_size}: need w13 [E, 2I, {hidden_size}] and w2 [E, {hidden_size}, I]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{what}: topk_weights and topk_ids must both be [tokens={tokens}, top_k], "
                         f"got {tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"{what}: topk_weights must be floating point, got {topk_weights.dtype}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"{what}: hidden, w13 and w2 must share a dtype, got {hidden.dtype}, {w13.dtype}, "
                         f"{w2.dtype}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * W2[e] (silu(W1[e] x_t) * W3[e] x_t), e = topk_ids[t, k]."""
    check_fused_moe_args("fused_moe", hidden, w13, w2, topk_weights, topk_ids)
    intermediate = w2.shape[2]

    def expert_mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, w13[expert]).split(intermediate, dim=-1)
        return F.linear(F.silu(gate) * up, w2[expert])

    return grouped_by_expert(hidden, topk_weights, topk_ids, w13.shape[0], expert_mlp)


def grouped_by_expert(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_mlp) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_mlp(e, x_t), e = topk_ids[t, k], with the numerics
    above; `expert_mlp(e, rows)` maps [n, hidden] rows to [n, hidden] (float experts here,
    quantized ones in engine/models/quant_moe.py).

    The (token, k) rows are grouped by expert with one stable sort and one gather, so each
    expert's matmuls see all of its tokens at once as a contiguous slice, and the results
    go back to (token, k) order with one scatter: per-expert scatters (index_add_) cost
    more than the matmuls on a CPU shared with other work."""
    tokens, top_k = topk_ids.shape
    hidden_size = hidden.shape[1]
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)  # (token, k) rows grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x = hidden.index_select(0, order // top_k)
    weights = topk_weights.reshape(-1).float()[order, None]
    sorted_out = torch.empty((order.numel(), hidden_size), dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        torch.mul(expert_mlp(expert, x[start:end]), weights[start:end], out=sorted_out[start:end])
        start = end
    per_row = torch.empty_like(sorted_out)
    per_row[order] = sorted_out
    return per_row.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
