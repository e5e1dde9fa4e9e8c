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
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 16}))
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
    (["--enable-lora", "-tp", "2"], "--enable-lora is not supported with --tensor-parallel-size > 1 yet"),
])
def test_bad_flags_are_one_line(argv, message):
    assert lora_problem(parse(*argv)) == message


def test_rank_and_duplicates_are_refused_before_start(adapter_dir):
    assert lora_problem(parse("--enable-lora", "--lora-modules", f"a={adapter_dir}")) == \
        "LoRA adapter 'a' has rank 32, above --max-lora-rank 16"
    assert lora_problem(parse("--enable-lora", "--max-lora-rank", "32", "--lora-modules", f"a={adapter_dir}",
                              f"a={adapter_dir}")) == "--lora-modules names 'a' twice"
