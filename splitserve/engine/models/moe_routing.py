"""DeepSeek-style routing (DeepSeek-V3, GLM-4.5/4.6/4.7), as one pure function: which
experts each token goes to, and with what weight.

1. scores: sigmoid (or softmax) of the router logits, in float32;
2. choice: scores + the checkpoint's `e_score_correction_bias` (load balancing learnt
   without an auxiliary loss). The bias decides *which* experts, never their weights;
3. grouped top-k: the experts form `n_group` equal groups; a group's score is the sum of
   its two best choice scores (what transformers does), only the `topk_group` best
   groups stay, and the top-k experts are picked from those;
4. weights: the picked experts' *uncorrected* scores, renormalised to sum to 1 when
   `norm_topk_prob`, times `routed_scaling_factor`.
Mixtral / Qwen3-MoE routing (softmax, plain top-k) is kernels/moe_reference.select_experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.core.model_config import ModelConfig


@dataclass(frozen=True)
class GroupedRouting:
    top_k: int
    scoring: str  # "sigmoid" or "softmax"
    n_group: int
    topk_group: int
    renormalize: bool
    scaling: float

    @classmethod
    def of(cls, cfg: ModelConfig) -> GroupedRouting:
        return cls(cfg.num_experts_per_tok, cfg.moe_scoring, cfg.moe_n_group, cfg.moe_topk_group,
                   cfg.norm_topk_prob, cfg.routed_scaling_factor)


def grouped_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                 r: GroupedRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [tokens, top_k], ids int64 [tokens, top_k]) for logits [tokens, experts]."""
    logits = router_logits.float()
    scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if r.n_group > 1 and r.topk_group < r.n_group:
        tokens, experts = choice.shape
        per_group = experts // r.n_group
        group_scores = choice.view(tokens, r.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        kept = group_scores.topk(r.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = choice.topk(r.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' epsilon
    return weights * r.scaling, ids
