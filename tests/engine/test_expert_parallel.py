"""Expert parallelism (--enable-expert-parallel, engine/parallel/expert_parallel.py) without
rank processes: the routing plan (N ranks simulated in one process give fused_moe's output),
which checkpoint tensors each rank reads, and the one-line refusals. Over two gloo ranks
against transformers: test_expert_parallel_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch

from splitserve.core.expert_parallel import expert_parallel_problem
from splitserve.core.model_config import ModelConfig
from splitserve.engine.parallel.expert_parallel import RoutingPlan, local_experts, token_share
from splitserve.engine.parallel.sharding import NOTHING, Shard, checkpoint_shard
from splitserve.engine.parallel.state import TPState
from splitserve.kernels.moe_reference import fused_moe, select_experts

# ---- the plan, N ranks simulated in one process -------------------------------------------

def test_token_share_covers_every_row_once_in_equal_padded_parts():
    for tokens in (1, 2, 3, 7, 32):
        for size in (2, 3, 4):
            shares = [token_share(tokens, r, size) for r in range(size)]
            assert len({padded for _, _, padded in shares}) == 1 and shares[0][2] >= 1
            rows = [i for start, n, _ in shares for i in range(start, start + n)]
            assert rows == list(range(tokens))


def simulate(x, w13, w2, weights, ids, size: int) -> torch.Tensor:
    """expert_parallel_moe's data movement with the collectives done by hand: shares, plans,
    the all-to-all there and back, each owner running fused_moe on its local stacks."""
    tokens, top_k = ids.shape
    per_rank = w13.shape[0] // size
    shares = [token_share(tokens, r, size) for r in range(size)]
    plans = [RoutingPlan.of(ids[s:s + n], per_rank, size) for s, n, _ in shares]
    sent = [plan.send(x[s:s + n], top_k).split(plan.send_rows) for plan, (s, n, _) in zip(plans, shares, strict=True)]
    local_ids = [plan.local_ids.split(plan.send_rows) for plan in plans]
    outputs = []  # per owner, its result split back per source
    for owner in range(size):
        rx = torch.cat([sent[src][owner] for src in range(size)])
        rids = torch.cat([local_ids[src][owner] for src in range(size)])
        assert all(0 <= i < per_rank for i in rids.tolist())
        local = slice(owner * per_rank, (owner + 1) * per_rank)
        out = fused_moe(rx, w13[local], w2[local], torch.ones(len(rx), 1), rids.unsqueeze(1)) if len(rx) else rx
        outputs.append(out.split([plans[src].send_rows[owner] for src in range(size)]))
    parts = []
    for src, (plan, (s, n, _)) in enumerate(zip(plans, shares, strict=True)):
        returned = torch.cat([outputs[owner][src] for owner in range(size)])
        parts.append(plan.combine(returned, weights[s:s + n], x.dtype))
    return torch.cat(parts)


@pytest.mark.parametrize("tokens,size", [(1, 2), (5, 2), (37, 2), (37, 4), (9, 8)])
def test_simulated_ranks_give_fused_moes_output(tokens, size):
    torch.manual_seed(tokens * size)
    experts, hidden, inter, top_k = 8, 16, 12, 3
    x = torch.randn(tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden) * 0.3, torch.randn(experts, hidden, inter) * 0.3
    weights, ids = select_experts(torch.randn(tokens, experts), top_k, renormalize=True)
    torch.testing.assert_close(simulate(x, w13, w2, weights, ids, size), fused_moe(x, w13, w2, weights, ids),
                               rtol=1e-6, atol=1e-6)


def test_the_plan_sends_each_row_to_its_experts_owner_in_token_order():
    ids = torch.tensor([[3, 0], [1, 2], [2, 3]])  # 4 experts over 2 ranks: 0-1 on rank 0, 2-3 on rank 1
    plan = RoutingPlan.of(ids, 2, 2)
    assert plan.send_rows == [2, 4]
    assert plan.order.tolist() == [1, 2, 0, 3, 4, 5]  # flat (token, k): rank 0's rows, then rank 1's
    assert plan.local_ids.tolist() == [0, 1, 1, 0, 0, 1]


# ---- what each rank reads, and the refusals -----------------------------------------------

def moe_config(experts: int = 8) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["MixtralForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_local_experts": experts})


def test_each_rank_reads_its_own_experts_whole_and_nothing_of_the_others():
    cfg = moe_config()
    ep = [TPState(r, 2, expert_parallel=True) for r in range(2)]
    assert [local_experts(cfg, t) for t in ep] == [(0, 4), (4, 4)]
    name = "model.layers.1.block_sparse_moe.experts.5.w1.weight"
    assert [checkpoint_shard(name, cfg, t) for t in ep] == [NOTHING, None]
    assert checkpoint_shard(name, cfg, TPState(1, 2)) == Shard(0, 24, 24)  # tensor-parallel: a slice
    stacked = "model.layers.0.mlp.experts.gate_up_proj"
    assert [checkpoint_shard(stacked, cfg, t) for t in ep] == [Shard(0, 0, 4), Shard(0, 4, 4)]
    # attention and the router stay as tensor parallelism has them
    assert checkpoint_shard("model.layers.0.self_attn.q_proj.weight", cfg, ep[1]) == Shard(0, 16, 16)
    assert checkpoint_shard("model.layers.0.block_sparse_moe.gate.weight", cfg, ep[1]) is None


def test_refusals_are_one_line():
    assert expert_parallel_problem(moe_config(), 1) == (
        "expert parallelism spreads the experts over the tensor-parallel ranks: it needs tensor parallelism "
        "(size > 1)")
    assert expert_parallel_problem(moe_config(6), 4) == "MixtralForCausalLM's 6 experts do not split evenly over 4 ranks"
    dense = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                   "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4})
    assert expert_parallel_problem(dense, 2) == ("LlamaForCausalLM has no mixture-of-experts layers: expert "
                                                 "parallelism needs an MoE model")
    assert expert_parallel_problem(moe_config(), 2) is None
    with pytest.raises(ValueError, match="^expert parallelism: 6 experts do not split evenly over 4 ranks$"):
        local_experts(moe_config(6), TPState(0, 4, expert_parallel=True))


def test_engine_config_refuses_a_dense_model_and_a_single_rank(make_ckpt):
    from splitserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="^enable_expert_parallel: LlamaForCausalLM has no mixture-of-experts layers"):
        EngineConfig(model=str(make_ckpt("llama")), tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="^enable_expert_parallel: expert parallelism spreads the experts"):
        EngineConfig(model=str(make_ckpt("mixtral")), enable_expert_parallel=True)
