"""GLM-5 (`GlmMoeDsaForCausalLM`: DeepSeek-V3.2's sparse attention with the indexer's rope in
interleaved pairs and layers that reuse the previous indexer layer's choice) against
transformers (float32, CPU): a top-k of 16, a prompt of 45 tokens and 40 new ones (transformers
takes ~16 s a reference here, so one prompt; DeepSeek-V3.2's test has the short one too),
chunked prefill and a prefix-cache hit, with layer 1 sharing layer 0's choice; and how
transformers derives the shared layers from a config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from tests.engine.test_deepseek_v3 import prompts
from tests.engine.test_deepseek_v32 import CONFIG as V32_CONFIG
from tests.helpers.reference import hf_greedy

NEW_TOKENS = 40
CONFIG = {**{k: v for k, v in V32_CONFIG.items() if k not in ("n_group", "topk_group")},
          "indexer_types": ["full", "shared", "full"]}


def write_glm_moe_dsa(out: Path, seed: int = 0, **overrides) -> Path:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = GlmMoeDsaConfig(vocab_size=tok.get_vocab_size(), architectures=["GlmMoeDsaForCausalLM"],
                          bos_token_id=0, eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_routed_experts))
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:  # an indexer sharp enough that its choice matters
                layer.self_attn.indexer.wq_b.weight.normal_(0, 0.5)
                layer.self_attn.indexer.wk.weight.normal_(0, 0.5)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_glm_moe_dsa(tmp_path_factory.mktemp("glm_moe_dsa") / "float")


def test_config_reads_the_shared_indexer_layers_as_transformers_derives_them(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.family, cfg.index_topk, cfg.index_shared_layers, cfg.index_rope_interleave) == (
        "glm_moe_dsa", 16, (1,), True)
    raw = {k: v for k, v in json.loads((ckpt / "config.json").read_text()).items() if k != "indexer_types"}
    assert ModelConfig.from_dict({**raw, "index_topk_pattern": "FSS"}).index_shared_layers == (1, 2)
    # transformers' freq/offset schedule: every 2nd layer from the 2nd on keeps an indexer
    from transformers import GlmMoeDsaConfig

    want = GlmMoeDsaConfig(num_hidden_layers=3, index_topk_freq=2, index_skip_topk_offset=1).indexer_types
    got = ModelConfig.from_dict({**raw, "index_topk_freq": 2, "index_skip_topk_offset": 1}).index_shared_layers
    assert got == tuple(i for i, t in enumerate(want) if t == "shared") and got
    with pytest.raises(CheckpointError, match=r"field 'indexer_types' must list 'full' or 'shared' for each of the 3 "
                                              r"layers, the first 'full'"):
        ModelConfig.from_dict({**raw, "indexer_types": ["shared", "full", "full"]}, source="x.json")


def test_greedy_tokens_equal_transformers_past_the_top_k_with_chunks_and_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    assert model.layers[1].self_attn.indexer is None and model.layers[2].self_attn.indexer is not None
    ps = prompts(llm.engine.model_config.vocab_size)[1:]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(ps, llm.generate(ps, params), strict=True):
        assert out.token_ids == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    again = ps[0][:40] + [9, 10, 11]
    hit = llm.generate([again], params)[0]
    assert hit.num_cached_tokens >= 32 and hit.token_ids == hf_greedy(ckpt, again, NEW_TOKENS)
