"""Which quantization a checkpoint uses, and one line for anything not supported
(core/quantization.py): unknown methods (served silently as float before issue 31),
settings outside a supported method, --quantization that does not match, quantized
tensors without a quantization_config and the reverse; `serve` exits 2 with that line,
before Ray, without a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from splitserve.core.model_config import CheckpointError
from splitserve.core.model_dir import checkpoint_problem
from splitserve.core.quantization import QuantSpec, quantization_from_config
from splitserve.engine import LLM
from tests.engine.test_quant_formats import quantize_checkpoint

SUPPORTED = ("(supported: fp8 (block-wise or per-tensor), gptq and awq (4-bit), compressed-tensors (float-quantized, "
             "pack-quantized, naive-quantized, int-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized), "
             "mxfp4 (gpt-oss))")
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True}

REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     "quantization method 'bitsandbytes' is not supported"),
    "hqq": ({"quant_method": "hqq"}, "quantization method 'hqq' is not supported"),
    "invented": ({"quant_method": "magic-bits"}, "quantization method 'magic-bits' is not supported"),
    "no-method": ({"bits": 4}, "quantization method None is not supported"),
    "gptq-3-bit": (GPTQ | {"bits": 3}, "gptq with bits 3 (only 4-bit) is not supported"),
    "gptq-marlin-format": (GPTQ | {"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin' is not supported"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
                 "awq version 'gemv' (only the GEMM packing) is not supported"),
    "awq-no-zero-point": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
                          "awq with zero_point false is not supported"),
    "fp8-odd-blocks": ({"quant_method": "fp8", "weight_block_size": [128]},
                       "fp8 with weight_block_size [128] (need [rows, cols], e.g. [128, 128]) is not supported"),
    "fp8-e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
                 "fp8 fmt 'e5m2' (only e4m3 weights) is not supported"),
    "ct-nvfp4-no-group": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                           "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float"}}}},
                          "compressed-tensors nvfp4-pack-quantized float4 group None (fp4, symmetric, group 16) "
                          "is not supported"),
    "ct-mxfp6": ({"quant_method": "compressed-tensors", "format": "mxfp6-pack-quantized",
                  "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 6, "type": "float"}}}},
                 "compressed-tensors format 'mxfp6-pack-quantized' is not supported"),
    "ct-int2": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 2, "type": "int",
                                                                            "strategy": "group", "group_size": 64}}}},
                "compressed-tensors pack-quantized int2 group (int4/8, channel or group) is not supported"),
    "ct-actorder": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                     "config_groups": {"g": {"targets": ["Linear"], "weights": {
                         "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "dynamic"}}}},
                    "compressed-tensors pack-quantized with actorder 'dynamic' is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_unsupported_method_or_setting_is_one_line(case):
    qc, expected = REFUSED[case]
    with pytest.raises(CheckpointError) as err:
        quantization_from_config({"quantization_config": qc}, "m/config.json")
    assert str(err.value) == f"m/config.json: {expected} {SUPPORTED}"


def test_supported_settings_are_read():
    assert quantization_from_config({}) is None
    assert quantization_from_config({"quantization_config": GPTQ}) == QuantSpec(
        "gptq", "gptq", bits=4, group_size=128, symmetric=True, desc_act=True, zero_plus_one=True)
    v2 = quantization_from_config({"quantization_config": GPTQ | {"checkpoint_format": "gptq_v2", "sym": False}})
    assert not v2.zero_plus_one and not v2.symmetric
    fp8 = quantization_from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                            "activation_scheme": "dynamic"}})
    assert fp8.block == (128, 128) and fp8.activations == "fp8 dynamic"
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    for actorder, desc_act in ((None, False), ("weight", False), ("static", False), ("group", True)):
        ct["config_groups"]["g"]["weights"]["actorder"] = actorder
        got = quantization_from_config({"quantization_config": ct})
        assert (got.format, got.bits, got.group_size, got.desc_act) == ("pack-quantized", 4, 128, desc_act)


def test_quantization_flag_must_match_the_checkpoint():
    with pytest.raises(CheckpointError) as err:
        quantization_from_config({"quantization_config": GPTQ}, "m/config.json", override="awq")
    assert str(err.value) == ("m/config.json: --quantization awq given, but the checkpoint is quantized with gptq "
                              "(drop the flag or pass --quantization gptq)")
    with pytest.raises(CheckpointError) as err:
        quantization_from_config({}, "m/config.json", override="fp8")
    assert str(err.value) == ("m/config.json: --quantization fp8 given, but the checkpoint has no "
                              "quantization_config (it is a float checkpoint; drop the flag)")
    assert quantization_from_config({"quantization_config": GPTQ}, override="gptq").method == "gptq"


def _copy(src, tmp_path):
    """A copy to change: make_ckpt's checkpoints are shared by the session."""
    return shutil.copytree(src, tmp_path / "model")


def _set_quantization_config(d, qc):
    cfg = json.loads((d / "config.json").read_text())
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))


def test_tensors_and_config_must_agree(make_ckpt, tmp_path):
    qdir, rdir = quantize_checkpoint(make_ckpt("llama", hidden_size=256, intermediate_size=384), tmp_path, "gptq")
    assert checkpoint_problem(str(qdir)) is None
    assert checkpoint_problem(str(qdir), "gptq") is None
    assert "--quantization awq given" in checkpoint_problem(str(qdir), "awq")
    _set_quantization_config(qdir, None)
    assert checkpoint_problem(str(qdir)) == (
        f"{qdir}: holds quantized tensors (e.g. 'model.layers.0.mlp.down_proj.g_idx') but config.json has no "
        "quantization_config: an incomplete checkpoint (copy config.json from the quantized release)")
    _set_quantization_config(rdir, GPTQ)
    assert checkpoint_problem(str(rdir)) == (
        f"{rdir}: config.json says gptq 4-bit, group 128, sym, act-order, but no tensor ends in '.qweight': the "
        "weights are not in that format (a float checkpoint with a stray quantization_config?)")


def test_a_quantized_linear_missing_a_tensor_or_of_another_dtype_is_one_line(make_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    qdir, _ = quantize_checkpoint(make_ckpt("llama", hidden_size=192, intermediate_size=320), tmp_path, "fp8-block")
    path = qdir / "model.safetensors"
    tensors = load_file(str(path))
    scale = tensors.pop("model.layers.1.mlp.up_proj.weight_scale_inv")
    save_file({"w": tensors["model.layers.1.mlp.up_proj.weight"]}, str(qdir.parent / "w.st"))
    save_file(tensors, str(path))
    assert checkpoint_problem(str(qdir)) == (
        f"{qdir}: model.layers.1.mlp.up_proj.weight (F8_E4M3) belongs to no quantized linear: there is no "
        "model.layers.1.mlp.up_proj.weight_scale_inv (fp8 block-wise 128x128)")
    # the engine alone (no serve check first) refuses it too, instead of casting codes to float
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is torch.float8_e4m3fn, "
                                              "quantized codes that no quantization_config describes"):
        LLM(str(qdir), num_kv_blocks=16)
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = scale
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    assert checkpoint_problem(str(qdir)) == (
        f"{qdir}: quantized linear 'model.layers.1.mlp.up_proj' lacks ['weight'] (fp8 block-wise 128x128)")
    with pytest.raises(CheckpointError, match="quantized linear 'model.layers.1.mlp.up_proj' lacks \\['weight'\\]"):
        LLM(str(qdir), num_kv_blocks=16)
    tensors = load_file(str(path)) | {"model.layers.1.mlp.up_proj.weight": load_file(str(qdir.parent / "w.st"))["w"]}
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"].to(
        torch.float8_e5m2)
    save_file(tensors, str(path))
    assert checkpoint_problem(str(qdir)) == (
        f"{qdir}: model.layers.0.self_attn.o_proj.weight is F8_E5M2; fp8 block-wise 128x128 stores F8_E4M3 there "
        "(e5m2 FP8 weights are not supported)")


# ~5 s of `serve` start-up a case here: the edit loop runs one refusal per check (the method in
# config.json, the tensors against it, the flag); the other config refusals take bitsandbytes' path
# (their messages are checked above) and run in `make test` (marker slow).
@pytest.mark.parametrize("case", ["bitsandbytes", pytest.param("invented", marks=pytest.mark.slow),
                                  pytest.param("gptq-3-bit", marks=pytest.mark.slow), "no-tensors", "flag-mismatch"])
def test_serve_exits_2_with_one_line(make_ckpt, tmp_path, case):
    d = _copy(make_ckpt("llama"), tmp_path)
    args = []
    if case == "no-tensors":
        qc, expected = GPTQ, "but no tensor ends in '.qweight'"
    elif case == "flag-mismatch":
        qc, expected, args = None, "--quantization awq given, but the checkpoint has no quantization_config", \
            ["--quantization", "awq"]
    else:
        qc, expected = REFUSED[case][0], REFUSED[case][1]
    _set_quantization_config(d, qc)
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "serve", "--model", str(d), *args],
                          capture_output=True, text=True, timeout=60)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_the_flag_reaches_the_engine_and_is_checked_there(make_ckpt, tmp_path):
    import argparse

    from splitserve.engine.args import add_engine_args, engine_config_from_args

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--quantization", "awq"])
    assert engine_config_from_args(args, "m", "m").quantization == "awq"
    with pytest.raises(SystemExit):
        ap.parse_args(["--quantization", "bitsandbytes"])  # argparse lists the choices
    qdir, _ = quantize_checkpoint(make_ckpt("llama", hidden_size=256, intermediate_size=384), tmp_path, "gptq")
    with pytest.raises(CheckpointError, match="--quantization awq given, but the checkpoint is quantized with gptq"):
        LLM(str(qdir), num_kv_blocks=16, quantization="awq")
    assert LLM(str(qdir), num_kv_blocks=16, quantization="gptq").engine.config.quantization == "gptq"
