"""Mixtral and Qwen3-MoE specifics: which layers are sparse and how they route (as
transformers decides), and expert weights from both checkpoint layouts - one tensor per
expert (what transformers saves) and the stacked 3-D tensors transformers 5 holds in
memory. Token-for-token fidelity against generate is in test_model_families.py."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models import moe
from tests.helpers.reference import hf_greedy, hf_model

QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


@pytest.mark.parametrize("fields", [
    {},
    {"mlp_only_layers": [0, 4], "decoder_sparse_step": 1},
    {"decoder_sparse_step": 2},
    {"decoder_sparse_step": 3, "mlp_only_layers": [5]},
])
def test_qwen3_moe_sparse_layers_are_the_ones_transformers_builds(fields):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    raw = {**QWEN3_MOE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, **fields}
    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    hf_sparse = tuple(i for i in range(6) if isinstance(Qwen3MoeDecoderLayer(hf_cfg, i).mlp, Qwen3MoeSparseMoeBlock))
    cfg = ModelConfig.from_dict(raw)
    assert cfg.moe_layers == hf_sparse
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 16)


def test_expert_counts_under_either_name_and_the_families_defaults():
    hub_style = ModelConfig.from_dict({**QWEN3_MOE, "num_experts": 16})  # Qwen's published configs
    saved_by_transformers_5 = ModelConfig.from_dict({**QWEN3_MOE, "num_local_experts": 16})
    assert hub_style.num_experts == saved_by_transformers_5.num_experts == 16
    assert (hub_style.num_experts_per_tok, hub_style.moe_intermediate_size, hub_style.norm_topk_prob) == (8, 768, False)
    assert hub_style.qk_norm
    mixtral = ModelConfig.from_dict({**QWEN3_MOE, "architectures": ["MixtralForCausalLM"]})
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 48)
    assert mixtral.norm_topk_prob and mixtral.moe_layers == tuple(range(6)) and not mixtral.qk_norm


def test_a_top_k_above_the_expert_count_is_refused():
    with pytest.raises(CheckpointError, match=r"^x.json: num_experts_per_tok is 9; it must be between 1 and the "
                                              r"number of experts \(8\)$"):
        ModelConfig.from_dict({**QWEN3_MOE, "num_experts": 8, "num_experts_per_tok": 9}, source="x.json")


@pytest.mark.parametrize("name,target", [
    ("block_sparse_moe.gate.weight", ("mlp.gate.weight", None)),
    ("block_sparse_moe.experts.3.w1.weight", ("mlp.w13", (3, slice(0, 80)))),
    ("block_sparse_moe.experts.3.w3.weight", ("mlp.w13", (3, slice(80, 160)))),
    ("block_sparse_moe.experts.7.w2.weight", ("mlp.w2", (7,))),
    ("mlp.gate.weight", ("mlp.gate.weight", None)),
    ("mlp.experts.12.gate_proj.weight", ("mlp.w13", (12, slice(0, 80)))),
    ("mlp.experts.12.up_proj.weight", ("mlp.w13", (12, slice(80, 160)))),
    ("mlp.experts.0.down_proj.weight", ("mlp.w2", (0,))),
    ("mlp.experts.gate_up_proj", ("mlp.w13", None)),
    ("mlp.experts.down_proj", ("mlp.w2", None)),
    ("mlp.gate_proj.weight", None),  # a dense layer's MLP: not an expert tensor
    ("self_attn.q_norm.weight", None),
])
def test_expert_tensor_names_of_both_layouts(name, target):
    assert moe.expert_weight_target(name, intermediate=80) == target


def _stacked_copy(src, dst, transpose: bool = False):
    """The checkpoint re-saved with transformers 5's in-memory names and stacked experts."""
    state = {k: v.contiguous() for k, v in hf_model(str(src)).state_dict().items()}
    stacked = [k for k in state if k.endswith("experts.gate_up_proj")]
    assert stacked and all(state[k].dim() == 3 for k in stacked)
    if transpose:
        for k in stacked:
            state[k] = state[k].transpose(1, 2).contiguous()
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return state


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_stacked_expert_layout_gives_the_same_tokens(make_ckpt, tmp_path, family):
    per_expert = make_ckpt(family)
    state = _stacked_copy(per_expert, tmp_path / "stacked")
    assert "model.layers.0.mlp.experts.down_proj" in state and "model.layers.0.mlp.gate.weight" in state
    assert not any(".experts.0." in k or "block_sparse_moe" in k for k in state)
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (9, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {path: [o.token_ids for o in LLM(str(path), num_kv_blocks=16).generate(prompts, params)]
            for path in (per_expert, tmp_path / "stacked")}
    assert outs[per_expert] == outs[tmp_path / "stacked"]
    assert outs[per_expert][1] == hf_greedy(per_expert, prompts[1], 12)


def test_a_transposed_stacked_layout_is_refused_with_both_shapes(make_ckpt, tmp_path):
    _stacked_copy(make_ckpt("qwen3_moe"), tmp_path / "transposed", transpose=True)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape "
                                              r"\(8, 128, 160\), config.json implies \(8, 160, 128\)"):
        LLM(str(tmp_path / "transposed"), num_kv_blocks=16)


def test_a_missing_expert_projection_is_named(make_ckpt, tmp_path):
    src = make_ckpt("mixtral")
    dst = tmp_path / "missing"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"checkpoint lacks tensors for \['layers.1.mlp.w13'\]"):
        LLM(str(dst), num_kv_blocks=16)


@pytest.mark.parametrize("family,weights_dtype", [("mixtral", torch.float32), ("qwen3_moe", torch.bfloat16)])
def test_routing_weights_reach_the_experts_in_transformers_dtype(monkeypatch, family, weights_dtype):
    """transformers' Qwen3-MoE router rounds its top-k weights to the activation dtype;
    Mixtral's hands them on in float32."""
    arch = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    cfg = ModelConfig.from_dict({**QWEN3_MOE, "architectures": [arch], "num_experts": 4, "num_experts_per_tok": 2})
    block = moe.SparseMoeBlock(cfg).to(torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p)
    seen = []
    monkeypatch.setattr(moe.ops, "fused_moe", lambda x, w13, w2, weights, ids: seen.append(weights.dtype) or x)
    block(torch.randn(3, 32, dtype=torch.bfloat16))
    assert seen == [weights_dtype]


def test_the_unsupported_line_lists_both_moe_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, "architectures": ["JambaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="'JambaForCausalLM' is not supported; supported: .*"
                                              "MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        ModelConfig.from_dir(tmp_path)
