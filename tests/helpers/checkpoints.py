"""Small random-weight checkpoints, saved by transformers exactly as real ones are.

The families deliberately differ in shape so one test covers more ground:
llama: GQA 2, head_dim 32, Llama-3 rope scaling; mistral: GQA 4, head_dim 16;
qwen2: GQA 4 (q/k/v bias), tied embeddings; qwen3: q/k norms, GQA 2; phi3: longrope
switching at 64 positions, partial rotary (24 of 32 dims), GQA 4 over 8 heads (fused
projections in the checkpoint); gemma2: soft-capping that bites (caps 5 and 8),
query_pre_attn_scalar != head_dim, sliding/global layers with a 32-token window; gemma3:
q/k norms, a 32-token window on 2 of 3 layers, local and global rope bases, linear
scaling on the global one; mixtral: top-2 of 8 experts, GQA 4; qwen3_moe: top-3 of 8
experts without renormalisation (transformers' default), q/k norms, its middle layer
dense (`mlp_only_layers`). The new families' norm weights are perturbed (see
write_checkpoint). `WINDOW` is the sliding window the windowed checkpoints use.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.run_cache import cached_checkpoint

FAMILY_CONFIGS = {
    "llama": dict(seed=11, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 1024}),
    "mistral": dict(seed=12, hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                    sliding_window=4096),
    "qwen2": dict(seed=13, hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                  tie_word_embeddings=True),
    "qwen3": dict(seed=14, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  perturb_norms=True),
    "phi3": dict(seed=15, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, pad_token_id=0,
                 original_max_position_embeddings=64, perturb_norms=True,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0 + 0.05 * i for i in range(12)],
                                  "long_factor": [1.0 + 0.4 * i for i in range(12)]}),
    "gemma2": dict(seed=16, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   query_pre_attn_scalar=24, sliding_window=32, attn_logit_softcapping=5.0,
                   final_logit_softcapping=8.0, tie_word_embeddings=True, perturb_norms=True),
    "gemma3": dict(seed=17, hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                   num_hidden_layers=3, query_pre_attn_scalar=32, sliding_window=32,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}},
                   tie_word_embeddings=True, perturb_norms=True),
    "mixtral": dict(seed=18, hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=32, num_local_experts=8, num_experts_per_tok=2, perturb_norms=True),
    "qwen3_moe": dict(seed=19, hidden_size=128, intermediate_size=192, moe_intermediate_size=80,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1], perturb_norms=True),
}
WINDOW = 32


def make_checkpoint(root: Path, family: str, **overrides) -> Path:
    fields = dict(FAMILY_CONFIGS[family])
    fields.update(overrides)
    name = family + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    out = root / name
    if not (out / "config.json").is_file():
        cached_checkpoint(out, family, fields)  # built once, reused by later runs (tests/helpers/run_cache.py)
    return out
