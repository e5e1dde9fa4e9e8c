"""Small random-weight checkpoints, saved by transformers exactly as real ones are.

The three families deliberately differ in shape so one test covers more ground:
llama: GQA 2, head_dim 32, Llama-3 rope scaling; mistral: GQA 4, head_dim 16;
qwen2: GQA 4 (q/k/v bias), tied embeddings.
"""

from __future__ import annotations

from pathlib import Path

from splitserve.engine.demo import write_checkpoint

FAMILY_CONFIGS = {
    "llama": dict(seed=11, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 1024}),
    "mistral": dict(seed=12, hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                    sliding_window=4096),
    "qwen2": dict(seed=13, hidden_size=128, num_attention_heads=4, num_key_value_heads=1,
                  tie_word_embeddings=True),
}


def make_checkpoint(root: Path, family: str, **overrides) -> Path:
    fields = dict(FAMILY_CONFIGS[family])
    fields.update(overrides)
    name = family + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    out = root / name
    if not (out / "config.json").is_file():
        write_checkpoint(out, family, **fields)
    return out
