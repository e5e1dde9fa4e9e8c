"""MiniMax-M2 (`MiniMaxM2ForCausalLM`) against transformers (float32, CPU): the router equal
to transformers' (sigmoid scores, correction bias for the choice only, plain top-k,
renormalised), the q/k RMSNorm over the whole projection (also split over two ranks, as
tensor parallelism runs it), the config as transformers reads it, and greedy tokens (and
top-5 logprobs within 1e-4) through LLM on a tiny random checkpoint: every layer sparse,
a nonzero correction bias, partial rotary (rotary_dim 16 of 32); prompts longer than a
block (16) and than a chunk (32), a prefix-cache hit, and the FP8 block-wise checkpoint of
the same model. Tensor parallelism: test_minimax_m2_tensor_parallel.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models import minimax_m2
from splitserve.engine.models.moe_routing import GroupedRouting, grouped_topk
from splitserve.engine.models.quant_moe import QuantizedExperts
from splitserve.engine.parallel.state import TPState
from tests.engine.test_quant_formats import LINEARS, quantize_checkpoint
from tests.helpers.reference import (
    assert_greedy_and_top_logprobs_equal,
    assert_prefix_hit_equals_transformers,
    hf_greedy,
)

NEW_TOKENS = 40
CONFIG = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, num_local_experts=8, num_experts_per_tok=3, rotary_dim=16, max_position_embeddings=512)


def write_minimax_m2(out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny MiniMax-M2 saved by transformers; weights wider than its 0.02 init (so tokens
    are not one repeated id) and a router sharp enough that the bias decides choices."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = MiniMaxM2Config(vocab_size=tok.get_vocab_size(), architectures=["MiniMaxM2ForCausalLM"],
                          bos_token_id=0, eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.num_local_experts))  # a buffer
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_minimax_m2(tmp_path_factory.mktemp("minimax_m2") / "float")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 45)]  # 45: three blocks, two chunks


def test_routing_equals_transformers_router_and_the_bias_decides():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    torch.manual_seed(1)
    router = MiniMaxM2TopKRouter(MiniMaxM2Config(**{**CONFIG, "hidden_size": 16}))
    bias = 0.3 * torch.randn(8)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
    logits, want_w, want_ids = router(torch.randn(200, 16), bias)
    r = GroupedRouting(top_k=3, scoring="sigmoid", n_group=1, topk_group=1, renormalize=True, scaling=1.0)
    got_w, got_ids = grouped_topk(logits, bias, r)
    order_got, order_want = got_ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices),
                               rtol=0, atol=1e-6)
    assert not torch.equal(grouped_topk(logits, None, r)[1].sort(dim=-1).values, order_got.values)


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: the one KV head replicated on both ranks
def test_whole_projection_norms_equal_transformers_also_split_over_two_ranks(monkeypatch, kv_heads):
    """Each rank normalises its half of the q heads (and its KV heads) with the sums of squares
    of all of them: a fake 2-rank all-reduce records each rank's partial sums, then adds them."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    torch.manual_seed(2)
    d, shapes = 8, {"q": 4, "k": kv_heads}
    x = {n: torch.randn(5, h, d) for n, h in shapes.items()}
    hf = {n: MiniMaxM2RMSNorm(h * d, 1e-6) for n, h in shapes.items()}
    for norm in hf.values():
        norm.weight.data.copy_(1 + 0.1 * torch.randn(norm.weight.shape))
    want = {n: hf[n](x[n].reshape(5, -1)).view_as(x[n]) for n in shapes}

    def norms(heads_of):  # (first, n) of q's and k's heads -> the attention's two norms
        made = {n: minimax_m2.WholeProjectionRMSNorm(h, d, *heads_of[n], 1e-6) for n, h in shapes.items()}
        for n, norm in made.items():
            norm.load_state_dict(hf[n].state_dict())
        return SimpleNamespace(q_norm=made["q"], k_norm=made["k"])

    whole = minimax_m2.MiniMaxM2Attention.norm_qk(norms({"q": (0, 4), "k": (0, kv_heads)}), x["q"], x["k"])
    for got, n in zip(whole, "qk", strict=True):
        torch.testing.assert_close(got, want[n], rtol=0, atol=1e-6)

    partials: dict[int, torch.Tensor] = {}
    for phase in ("record", "reduce"):
        for rank in (0, 1):
            heads = {"q": (2 * rank, 2), "k": (rank, 1) if kv_heads == 2 else (0, 1)}
            monkeypatch.setattr(minimax_m2, "tp", lambda rank=rank: TPState(rank, 2))
            monkeypatch.setattr(minimax_m2, "all_reduce", (lambda s, rank=rank: partials.setdefault(rank, s))
                                if phase == "record" else (lambda s: partials[0] + partials[1]))
            mine = {n: x[n][:, f:f + c] for n, (f, c) in heads.items()}
            got = minimax_m2.MiniMaxM2Attention.norm_qk(norms(heads), mine["q"], mine["k"])
            if phase == "reduce":
                for g, n in zip(got, "qk", strict=True):
                    f, c = heads[n]
                    torch.testing.assert_close(g, want[n][:, f:f + c], rtol=0, atol=1e-6)


def test_config_reads_what_transformers_builds(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.family, cfg.moe_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("minimax_m2", (0, 1, 2), 8, 3)
    assert (cfg.moe_intermediate_size, cfg.moe_scoring, cfg.moe_n_group, cfg.routed_scaling_factor) == (32, "sigmoid",
                                                                                                       1, 1.0)
    assert (cfg.n_shared_experts, cfg.norm_topk_prob, cfg.qk_norm, cfg.qkv_bias, cfg.sliding_window) == (0, True,
                                                                                                          False, False,
                                                                                                          None)
    assert (cfg.rope.rotary_dim, cfg.rope.theta) == (16, 5_000_000.0)
    # as MiniMax's own config.json says it: rotary_dim and rope_theta at the top, no rope_parameters
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["rope_parameters"]
    assert (ModelConfig.from_dict(raw).rope.rotary_dim, ModelConfig.from_dict(raw).rope.theta) == (16, 5_000_000.0)
    assert ModelConfig.from_dict({**raw, "sliding_window": 8}).sliding_window is None  # transformers ignores it
    del raw["head_dim"]
    assert ModelConfig.from_dict(raw).head_dim == 128  # transformers' default, not hidden_size // heads


@pytest.mark.parametrize("fields,why", [
    ({"scoring_func": "softmax"}, r"scoring_func 'softmax' is not supported for MiniMax-M2 \(supported: 'sigmoid', "
                                  r"the only one transformers implements\)$"),
    ({"shared_intermediate_size": 64}, r"shared_intermediate_size is 64; MiniMax-M2 with shared experts is not "
                                       r"supported \(transformers has none\)$"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok is 9; it must be between 1 and the number of experts \(8\)$"),
])
def test_what_transformers_would_serve_differently_is_refused_in_one_line(ckpt, fields, why):
    raw = {**json.loads((ckpt / "config.json").read_text()), **fields}
    with pytest.raises(CheckpointError, match=r"^x.json: " + why):
        ModelConfig.from_dict(raw, source="x.json")


def test_greedy_tokens_equal_transformers_with_chunks_and_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    assert_greedy_and_top_logprobs_equal(ckpt, ps, llm.generate(ps, params), NEW_TOKENS)
    assert_prefix_hit_equals_transformers(llm, ckpt, ps[1][:40] + [9, 10, 11], NEW_TOKENS, min_cached=32)
    model = llm.engine.runner.model
    # CPU decode steps did not take the prepared attention, which knows no whole-projection norm
    assert model.layers[0].self_attn.prepared_decode is None
    # the multi-token-prediction modules after the last layer are not read; the bias's two names
    assert model.weight_target("model.layers.3.block_sparse_moe.experts.0.w1.weight") is None
    for prefix in ("block_sparse_moe", "mlp"):
        assert model.weight_target(f"model.layers.2.{prefix}.e_score_correction_bias") == (
            "layers.2.mlp.gate.e_score_correction_bias", None)
    assert model.weight_target("model.layers.1.mlp.experts.gate_up_proj") == ("layers.1.mlp.w13", None)
    assert model.weight_target("model.layers.1.block_sparse_moe.experts.5.w3.weight") == (
        "layers.1.mlp.w13", (5, slice(32, 64)))


@pytest.mark.parametrize("module,rows,why", [
    ("block_sparse_moe.experts.0.w1", 32, "block_sparse_moe.experts.0.w1: MoE experts are not supported$"),
    ("block_sparse_moe.gate", 8, "block_sparse_moe.gate is not an attention or MLP projection of this model"),
])
def test_lora_on_experts_or_the_router_is_refused_as_for_every_moe_family(ckpt, tmp_path, module, rows, why):
    from safetensors.torch import save_file

    from splitserve.engine.lora import LoRAAdapterError

    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": [module.rpartition(".")[2]]}))
    prefix = f"base_model.model.model.layers.0.{module}"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(4, 64), f"{prefix}.lora_B.weight": torch.zeros(rows, 4)},
              str(path / "adapter_model.safetensors"))
    llm = LLM(str(ckpt), num_kv_blocks=16, enable_lora=True)
    with pytest.raises(LoRAAdapterError, match=why):
        llm.engine.loras.add("a", str(path))


def test_fp8_block_checkpoint_keeps_experts_quantized_and_equals_transformers_dequantised(ckpt, tmp_path):
    qdir, rdir = quantize_checkpoint(ckpt, tmp_path, "fp8-block", LINEARS + ("w1", "w2", "w3"))
    llm = LLM(str(qdir), num_kv_blocks=64, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    assert all(isinstance(model.layers[i].mlp.experts, QuantizedExperts) for i in range(3))
    ps = prompts(llm.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):
        assert out.token_ids == hf_greedy(rdir, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
