"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`: DeepSeek-V3 with DeepSeek sparse attention) against
transformers (float32, CPU) on a tiny random checkpoint whose indexer keeps 16 tokens: prompts
of 7 and 45 tokens and 40 new ones, so most queries see far more than the top-k, through
chunked prefill, a prefix-cache hit and TP=2; the index key in the cache row (its bytes per
token); and the selection deciding tokens (the same weights attending to everything differ)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from splitserve.core.model_config import CheckpointError, ModelConfig
from splitserve.engine import LLM, SamplingParams
from tests.engine.test_deepseek_v3 import CONFIG as V3_CONFIG
from tests.helpers.reference import hf_greedy

NEW_TOKENS = 40
# 16 index heads: a token scores exactly 0 (a tie the top-k breaks arbitrarily) only when all 16 relus
# are 0 (p = 2^-16); with 4 heads ties at the top-k boundary happened, and chunking then changed the choice
CONFIG = {**V3_CONFIG, "index_topk": 16, "index_n_heads": 16, "index_head_dim": 16}


def write_deepseek_v32(out: Path, seed: int = 0, **overrides) -> Path:
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    from splitserve.engine.demo import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    cfg = DeepseekV32Config(vocab_size=tok.get_vocab_size(), architectures=["DeepseekV32ForCausalLM"],
                            bos_token_id=0, eos_token_id=[1], **{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.n_routed_experts))
        for layer in model.model.layers:  # an indexer sharp enough that its choice matters
            layer.self_attn.indexer.wq_b.weight.normal_(0, 0.5)
            layer.self_attn.indexer.wk.weight.normal_(0, 0.5)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_deepseek_v32(tmp_path_factory.mktemp("deepseek_v32") / "float")


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (7, 45)]


def generate(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(ps, params)]


def test_config_and_the_index_key_in_the_cache_row(ckpt):
    cfg = ModelConfig.from_dir(ckpt)
    assert (cfg.family, cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == ("deepseek_v32", 16, 16, 16)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_parts) == (1, 32 + 8 + 16, 1)  # latent | rope key | index key
    spec = LLM(str(ckpt), num_kv_blocks=64).engine.runner.kv_pool.spec
    assert spec.block_nbytes // spec.block_size == (32 + 8 + 16) * 3 * 4
    raw = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"^x.json: DeepSeek sparse attention's indexer reads the query latent: "
                                              r"q_lora_rank must be set$"):
        ModelConfig.from_dict({**raw, "q_lora_rank": None}, source="x.json")
    with pytest.raises(CheckpointError, match=r"index_head_dim \(4\) is smaller than qk_rope_head_dim \(8\)"):
        ModelConfig.from_dict({**raw, "index_head_dim": 4}, source="x.json")


def test_greedy_tokens_equal_transformers_past_the_top_k_with_chunks_and_a_prefix_hit(ckpt):
    llm = LLM(str(ckpt), num_kv_blocks=64, max_num_batched_tokens=32)
    ps = prompts(llm.engine.model_config.vocab_size)
    for prompt, got in zip(ps, generate(llm, ps), strict=True):
        assert got == hf_greedy(ckpt, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    again = ps[1][:40] + [9, 10, 11]
    hit = llm.generate([again], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert hit.num_cached_tokens >= 32 and hit.token_ids == hf_greedy(ckpt, again, NEW_TOKENS)


def test_the_selection_decides_tokens(ckpt, tmp_path):
    """The same weights with a top-k above every context (dense attention) give other tokens:
    the sparse path is what the equality above checked."""
    dense = tmp_path / "dense"
    dense.mkdir()
    for f in ckpt.iterdir():
        (dense / f.name).symlink_to(f)
    (dense / "config.json").unlink()
    raw = json.loads((ckpt / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**raw, "index_topk": 4096}))
    prompt = prompts(1000)[1]
    sparse_tokens = generate(LLM(str(ckpt), num_kv_blocks=64), [prompt])[0]
    dense_tokens = generate(LLM(str(dense), num_kv_blocks=64), [prompt])[0]
    assert dense_tokens != sparse_tokens
    assert dense_tokens == hf_greedy(dense, prompt, NEW_TOKENS)  # the kernels' path when everything is selected

