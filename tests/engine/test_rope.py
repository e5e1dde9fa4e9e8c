"""Rope tables against transformers' own rope functions (modeling_rope_utils), for every
type the engine reads: inverse frequencies and the attention factor the cos/sin carry."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from splitserve.core.rope_config import read_rope
from splitserve.engine.models.rope import inverse_frequencies, rope_table

HEAD_DIM = 64
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 1024,
                 "short_factor": [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.0 + 0.3 * i for i in range(HEAD_DIM // 2)]},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_config(params: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=8192,
                       rope_parameters={"rope_theta": 50000.0, **params})


@pytest.mark.parametrize("name", list(CASES))
def test_inverse_frequencies_and_attention_factor_match_transformers(name):
    cfg = hf_config(CASES[name])
    spec, _ = read_rope(cfg.to_dict(), "llama", HEAD_DIM)
    kind = CASES[name]["rope_type"]
    lengths = [None]
    if kind == "longrope":
        lengths = [None, 1025]  # short factors, then long ones past the original length
    for seq_len in lengths:
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=seq_len)
        got, factor = inverse_frequencies(spec, HEAD_DIM, long=seq_len is not None)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert factor == pytest.approx(want_factor, rel=1e-9)


def test_longrope_table_holds_short_then_long_rows_scaled_by_the_attention_factor():
    cfg = hf_config(CASES["longrope"])
    spec, _ = read_rope(cfg.to_dict(), "llama", HEAD_DIM)
    table = rope_table(spec, HEAD_DIM, 2048, torch.float32, "cpu")
    assert table.long_after == 1024 and table.long_offset == 2048 and table.cos.shape == (4096, HEAD_DIM)
    long_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=1025)
    angle = 1500 * long_freq
    torch.testing.assert_close(table.cos[2048 + 1500, : HEAD_DIM // 2], angle.cos() * factor, rtol=1e-4, atol=1e-5)
