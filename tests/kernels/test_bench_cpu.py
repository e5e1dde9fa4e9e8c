"""The kernel benchmark's CPU path (toy model through the interpreter) and its accounting."""

from __future__ import annotations

import json

import torch

from splitserve.benchmark import kernels as bench
from splitserve.benchmark.kernels_model import LLAMA3_8B, TOY
from splitserve.kernels import ops

LLAMA3_8B_PARAMS = 8_030_261_248  # published parameter count
LLAMA3_8B_EMBEDDING = 128256 * 4096


def test_weight_bytes_per_step_is_the_llama3_8b_parameter_count():
    # everything but the embedding table is read each step; of the table, one row per token
    assert LLAMA3_8B.weight_bytes_per_step(1, 2) == 2 * (LLAMA3_8B_PARAMS - LLAMA3_8B_EMBEDDING + 4096)
    assert LLAMA3_8B.kv_bytes_read(1000, 2) == 1000 * 32 * 2 * 8 * 128 * 2


def test_prefill_flops_count_causal_attention_pairs():
    one = TOY.prefill_flops(1)
    two = TOY.prefill_flops(2)
    per_token_linear = 2 * TOY.num_layers * TOY.layer_matmul_params
    attention_pair = 4 * TOY.num_layers * TOY.num_heads * TOY.head_dim
    assert two - one == per_token_linear + 2 * attention_pair  # token 2 attends to 2 positions


def test_cpu_run_writes_json_that_says_its_figures_mean_nothing(tmp_path, capsys):
    if torch.cuda.is_available():
        return  # the GPU path is the benchmark proper, not a test
    out = tmp_path / "kernels.json"
    try:
        assert bench.main(["--out", str(out), "--batch-sizes", "1,2", "--hf-new-tokens", "6"]) == 0
    finally:
        ops.set_backend(None)
    result = json.loads(out.read_text())
    assert "MEANS NOTHING" in result["note"] and "MEANS NOTHING" in capsys.readouterr().err
    assert result["device"].startswith("cpu")
    assert result["model"]["hidden"] == TOY.hidden and result["model"]["num_layers"] == TOY.num_layers
    assert "kernels_model.py" in result["built_from"]
    assert result["peak"]["hbm_bytes_per_s"] > 0 and result["peak"]["matmul_flops_per_s"] > 0
    assert [r["batch"] for r in result["decode_attention"]] == [1, 2]
    assert all(r["bytes_per_s"] > 0 and 0 < r["fraction_of_peak"] for r in result["decode_attention"])
    steps = result["decode_step"]
    assert [(r["batch"], r["mode"]) for r in steps] == [(1, "eager"), (2, "eager")]
    assert steps[1]["bytes_read"] == TOY.weight_bytes_per_step(2, 4) + TOY.kv_bytes_read(2 * 25, 4)
    assert all(r["mbu"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    assert result["prefill"]["flops"] == TOY.prefill_flops(24) and result["prefill"]["mfu"] > 0
    hf = result["transformers"]
    assert [r["batch"] for r in hf["decode"]] == [1, 2] and all(r["mbu"] > 0 for r in hf["decode"])
    assert hf["prefill"]["tokens"] == 24 and hf["prefill"]["mfu"] > 0


def test_bad_arguments_are_refused_with_a_message(capsys):
    try:
        bench.main(["--batch-sizes", "1,x"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "--batch-sizes must be comma-separated integers" in capsys.readouterr().err
