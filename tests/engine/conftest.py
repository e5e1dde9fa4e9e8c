"""Fixtures the engine's LoRA modules share (test_lora_engine, test_lora_tensor_parallel,
test_async_scheduling_features): the tiny Llama base and the PEFT adapters of
tests/helpers/lora_adapters.ADAPTERS built on it, once per module. A module defining its own
`base` (test_spec_decode_paths) overrides it."""

from __future__ import annotations

import pytest

from tests.helpers.lora_adapters import ADAPTERS, make_adapter


@pytest.fixture(scope="module")
def base(make_ckpt):
    return make_ckpt("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()}
