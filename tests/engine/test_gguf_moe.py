"""A qwen3moe GGUF (llama.cpp's layout: each layer's experts stacked in `ffn_gate_exps` /
`ffn_up_exps` / `ffn_down_exps`, here Q4_0, Q4_0 and Q8_0; the router `ffn_gate_inp`
float), written here from a tiny Qwen3-MoE checkpoint, served as it ships: the experts
stay quantized, each expert's weight equals transformers' dequantisation of the same file,
and greedy tokens equal transformers' (float32) on it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file

from splitserve.core.model_config import ModelConfig
from splitserve.core.model_dir import checkpoint_problem
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.quant_moe import QuantizedExperts

NEW_TOKENS = 16
EXPERT_TYPES = {"gate_proj": ("ffn_gate_exps", "Q4_0"), "up_proj": ("ffn_up_exps", "Q4_0"),
                "down_proj": ("ffn_down_exps", "Q8_0")}
BLOCK_TENSORS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(src: Path, path: Path) -> None:
    """`src` (every layer sparse; 32 | moe_intermediate_size for Q8_0 blocks) as llama.cpp
    writes a qwen3moe GGUF: float attention, norms and router, quantized expert stacks."""
    cfg, tok = json.loads((src / "config.json").read_text()), json.loads((src / "tokenizer.json").read_text())
    w = GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = {i: t for t, i in tok["model"]["vocab"].items()} | added
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([tokens[i] for i in range(cfg["vocab_size"])])
    w.add_token_types([3 if i in added else 1 for i in range(cfg["vocab_size"])])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"][0])
    state = {k: v.float().numpy() for k, v in load_file(str(src / "model.safetensors")).items()}
    for hf, gg in (("embed_tokens", "token_embd"), ("norm", "output_norm")):
        w.add_tensor(f"{gg}.weight", state[f"model.{hf}.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    for b in range(cfg["num_hidden_layers"]):
        for hf, gg in BLOCK_TENSORS.items():
            w.add_tensor(f"blk.{b}.{gg}.weight", state[f"model.layers.{b}.{hf}.weight"])
        for proj, (gg, kind) in EXPERT_TYPES.items():
            stack = np.stack([state[f"model.layers.{b}.mlp.experts.{e}.{proj}.weight"]
                              for e in range(cfg["num_local_experts"])])
            codes = quantize(stack, GGMLQuantizationType[kind])
            w.add_tensor(f"blk.{b}.{gg}.weight", codes, raw_shape=codes.shape, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def qwen3moe_gguf(make_ckpt, tmp_path_factory) -> Path:
    src = make_ckpt("qwen3_moe", mlp_only_layers=[], moe_intermediate_size=96)
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen3moe.gguf"
    write_qwen3moe_gguf(src, path)
    return path


def hf_on_gguf(path: Path, cfg: ModelConfig):
    """transformers on the GGUF (its own dequantisation), with the derived config's two fixes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.moe_intermediate_size, config.norm_topk_prob = cfg.moe_intermediate_size, True
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                dtype=torch.float32).eval()


def test_a_qwen3moe_gguf_keeps_its_experts_quantized_and_matches_transformers(qwen3moe_gguf):
    assert checkpoint_problem(str(qwen3moe_gguf)) is None  # serve's pre-start check
    llm = LLM(str(qwen3moe_gguf), num_kv_blocks=32)
    cfg, model = llm.engine.model_config, llm.engine.runner.model
    # transformers' GGUF conversion leaves these out: the derived config.json has them from the metadata
    assert (cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.moe_layers) == (96, True, (0, 1, 2))
    hf = hf_on_gguf(qwen3moe_gguf, cfg)
    for layer in cfg.moe_layers:
        experts, hf_experts = model.layers[layer].mlp.experts, hf.model.layers[layer].mlp.experts
        assert isinstance(experts, QuantizedExperts)
        assert [p.bits for p in experts.w13[0].parts + experts.w2[0].parts] == [4, 8]
        for e in range(cfg.num_experts):
            assert torch.equal(experts.w13[e].parts[0].dequantize(), hf_experts.gate_up_proj[e]), (layer, e)
            assert torch.equal(experts.w2[e].parts[0].dequantize(), hf_experts.down_proj[e]), (layer, e)
    rng = random.Random(3)
    for n in (7, 40):
        prompt = [rng.randrange(5, cfg.vocab_size) for _ in range(n)]
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.token_ids == want[0, n:].tolist(), f"prompt of {n} tokens"
