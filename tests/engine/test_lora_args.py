"""The LoRA flags (vLLM's names) on serve and both workers: the one-line refusal checked
before any process starts, and the engine config they make."""

from __future__ import annotations

import argparse
import json

import pytest

from splitserve.engine.args import add_engine_args
from splitserve.engine.lora.args import lora_fields, lora_problem


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    return ap.parse_args(list(argv))


@pytest.fixture
def adapter_dir(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 16}))
    save_file({}, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


def test_the_flags_make_the_engine_config(adapter_dir):
    args = parse("--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules", f"sql={adapter_dir}")
    assert lora_problem(args) is None
    assert lora_fields(args) == dict(enable_lora=True, max_loras=3, max_lora_rank=32,
                                     lora_modules={"sql": str(adapter_dir)})
    assert lora_fields(parse()) == {} and lora_problem(parse()) is None


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "just-a-path"], "--lora-modules takes NAME=PATH, got 'just-a-path'"),
    (["--enable-lora", "--lora-modules", "a=/nowhere"], "LoRA adapter 'a': /nowhere is not a directory"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras and --max-lora-rank must be at least 1"),
])
def test_bad_flags_are_one_line(argv, message):
    assert lora_problem(parse(*argv)) == message


def test_rank_and_duplicates_are_refused_before_start(adapter_dir):
    assert lora_problem(parse("--enable-lora", "--lora-modules", f"a={adapter_dir}")) == \
        "LoRA adapter 'a' has rank 32, above --max-lora-rank 16"
    assert lora_problem(parse("--enable-lora", "--max-lora-rank", "32", "--lora-modules", f"a={adapter_dir}",
                              f"a={adapter_dir}")) == "--lora-modules names 'a' twice"


def test_shapes_are_checked_against_the_model_before_start(make_ckpt, tmp_path):
    from tests.helpers.lora_adapters import ADAPTERS, make_adapter

    llama, mistral = make_ckpt("llama"), make_ckpt("mistral")
    good = make_adapter(llama, tmp_path / "good", **ADAPTERS["all-r8"])
    other = make_adapter(mistral, tmp_path / "other", seed=4, r=4, alpha=8)
    assert lora_problem(parse("--model", str(llama), "--enable-lora", "--lora-modules", f"good={good}")) is None
    problem = lora_problem(parse("--model", str(llama), "--enable-lora", "--lora-modules", f"other={other}"))
    assert problem.startswith("LoRA adapter 'other' does not fit this model: model.layers.0.self_attn.k_proj has "
                              "lora_A (4, 128) and lora_B (32, 4), this model's k_proj is 128 -> 64"), problem
