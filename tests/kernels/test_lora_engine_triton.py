"""The engine with LoRA adapters and every kernel forced through Triton (the interpreter
here, the GPU elsewhere), the batched LoRA matmul included: a step mixing two PEFT adapters
and the base model gives transformers + PeftModel's greedy tokens, and the Triton LoRA
kernel is what ran."""

from __future__ import annotations

import random

import pytest

from splitserve.engine import LLM, LoRARequest, SamplingParams
from splitserve.kernels import ops, triton_lora
from tests.helpers.lora_adapters import ADAPTERS, make_adapter, peft_greedy

NEW = 4


@pytest.fixture
def lora_kernel_calls(monkeypatch):
    calls = []
    original = triton_lora.lora_delta

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_lora, "lora_delta", spy)
    yield calls
    ops.set_backend(None)


def test_mixed_adapters_through_triton_match_peft(make_ckpt, tmp_path, lora_kernel_calls, device):
    base = make_ckpt("llama")
    names = ["all-r8", "qv-r4-rslora"]
    paths = {n: make_adapter(base, tmp_path / n, **ADAPTERS[n]) for n in names}
    ops.set_backend("triton")
    llm = LLM(str(base), num_kv_blocks=32, max_num_batched_tokens=64, enable_lora=True, max_loras=2,
              device=str(device), cuda_graphs=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (20, 9, 17)]
    loras = [LoRARequest(names[0], 1, str(paths[names[0]])), None, LoRARequest(names[1], 2, str(paths[names[1]]))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs, strict=True):
        assert out.token_ids == peft_greedy(base, lora and paths[lora.lora_name], prompt, NEW), lora
    assert lora_kernel_calls  # the projections' deltas went through the Triton kernel
