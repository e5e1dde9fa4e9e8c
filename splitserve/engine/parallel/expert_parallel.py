"""Expert parallelism (vLLM's --enable-expert-parallel): a MoE layer's routed experts are
spread WHOLE over the tensor-parallel ranks, rank r holding experts [r*E/N, (r+1)*E/N) with
their full intermediate size, instead of every rank holding a 1/N slice of every expert.
Attention, dense MLPs and shared experts stay tensor-parallel.

Tensor-parallel attention leaves every rank with all T tokens, and every rank routes them
all (the router is replicated and small). Then, per MoE layer:
1. each rank takes its share of the tokens (token_share: ceil(T/N) rows, the last short);
2. the (token, k) rows of its share are sorted by the rank owning their expert
   (RoutingPlan) and sent there by all-to-all, with their expert ids made local;
3. each owner runs its local experts on what it received, unweighted (ops.fused_moe with
   top-1 and weight 1: the expert's output in the activation dtype, as the reference has it);
4. the outputs come back by the reverse all-to-all, land in (token, k) order, and the
   source rank weights and sums them in float32 in k order, rounded once (the numerics of
   kernels/moe_reference.py, so the result is the one-rank layer's);
5. an all-gather gives every rank the whole layer output.

Why all-to-all: tensor-parallel experts all-reduce a [T, hidden] partial sum per layer and
read every expert's weights on every rank; here a rank reads E/N experts' weights and moves
only its tokens' rows (top_k * T/N rows each way), which pays off when experts are many and
large. The split sizes are read on the host (one sync per layer), which a CUDA graph cannot
capture: expert parallelism runs eagerly (core/compatibility.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine.parallel.state import TPState, all_gather, all_to_all, tp

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, weights, local ids)


def local_experts(cfg: ModelConfig, t: TPState) -> tuple[int, int]:
    """(first expert, number of experts) this rank holds: all of them unless expert-parallel."""
    if not t.expert_parallel:
        return 0, cfg.num_experts
    if cfg.num_experts % t.size:
        raise ValueError(f"expert parallelism: {cfg.num_experts} experts do not split evenly over "
                         f"{t.size} ranks")
    per = cfg.num_experts // t.size
    return t.rank * per, per


def expert_intermediate(cfg: ModelConfig, t: TPState) -> int:
    """Each held expert's intermediate rows: all of them when whole, else this rank's slice."""
    return cfg.moe_intermediate_size if t.expert_parallel else cfg.moe_intermediate_size // t.size


def token_share(tokens: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first row, rows, rows padded to) of this rank's share of `tokens` rows: ceil(T/N)
    each (at least 1, so the all-gather has equal parts), the last ones short or empty."""
    per = max(1, -(-tokens // size))
    start = min(tokens, rank * per)
    return start, min(tokens, start + per) - start, per


@dataclass(frozen=True)
class RoutingPlan:
    """Where the (token, k) rows of one rank's share go. `order[i]` is the flat (token*k + j)
    index of the i-th row sent; rows are grouped by destination rank, stably, so each owner
    receives a source's rows in (token, k) order and the reverse all-to-all returns them to
    the same places."""

    order: torch.Tensor  # [rows*k] flat (token, k) indexes, sorted by owner rank
    local_ids: torch.Tensor  # [rows*k] the expert id on its owner, in `order`
    send_rows: list[int]  # rows to each rank

    @classmethod
    def of(cls, topk_ids: torch.Tensor, experts_per_rank: int, size: int) -> RoutingPlan:
        flat = topk_ids.reshape(-1).long()
        owner = flat // experts_per_rank
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=size)
        return cls(order, (flat - owner * experts_per_rank)[order], counts.tolist())

    def send(self, x: torch.Tensor, top_k: int) -> torch.Tensor:
        """The hidden rows to send, in order: row t of x once per chosen expert."""
        return x.index_select(0, self.order // top_k)

    def combine(self, returned: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, hidden]: the experts' outputs (returned in send order) weighted and summed
        over k in float32, in k order, rounded once to `dtype`."""
        rows, top_k = topk_weights.shape
        hidden = returned.shape[-1]
        per_row = torch.empty((rows * top_k, hidden), dtype=torch.float32, device=returned.device)
        per_row[self.order] = returned.float()
        weighted = per_row.view(rows, top_k, hidden) * topk_weights.float().unsqueeze(-1)
        return weighted.sum(dim=1).to(dtype)


def expert_parallel_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        experts_per_rank: int, run_local: ExpertsFn) -> torch.Tensor:
    """The MoE layer's routed output for all of `x`'s tokens, on every rank; `run_local(x,
    weights, ids)` computes this rank's experts (ids local, in [0, experts_per_rank))."""
    t = tp()
    tokens, top_k = topk_ids.shape
    start, rows, padded = token_share(tokens, t.rank, t.size)
    plan = RoutingPlan.of(topk_ids[start:start + rows], experts_per_rank, t.size)
    counts = torch.tensor(plan.send_rows, dtype=torch.int64, device=x.device)
    recv_rows = all_to_all(counts, [1] * t.size, [1] * t.size).tolist()  # the host learns the split
    recv_x = all_to_all(plan.send(x[start:start + rows], top_k), plan.send_rows, recv_rows)
    recv_ids = all_to_all(plan.local_ids, plan.send_rows, recv_rows)
    if recv_x.shape[0]:
        ones = torch.ones((recv_x.shape[0], 1), dtype=torch.float32, device=x.device)
        out = run_local(recv_x, ones, recv_ids.unsqueeze(1))
    else:
        out = recv_x  # nothing to compute (a kernel may not take zero rows)
    returned = all_to_all(out, recv_rows, plan.send_rows)
    share = plan.combine(returned, topk_weights[start:start + rows], x.dtype)
    if rows < padded:
        share = torch.cat([share, share.new_zeros(padded - rows, share.shape[1])])
    return all_gather(share, dim=0)[:tokens]
