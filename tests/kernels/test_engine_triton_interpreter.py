"""The engine's greedy tokens do not change when every kernel is forced through Triton
(the interpreter here, the GPU elsewhere) instead of the torch reference.

The engine's own fidelity test (chunked prefill, prefix hits, preemption, against
transformers) is rerun with Triton forced for Llama; through the interpreter it takes
about 45 s, so the other families get a shorter workload that still mixes chunked
prefill with decode."""

from __future__ import annotations

import random

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.kernels import ops, triton_ops
from tests.engine import test_fidelity
from tests.helpers.reference import hf_greedy

KERNELS = ["paged_decode_attention", "paged_prefill_attention", "store_kv", "rms_norm", "apply_rotary"]


@pytest.fixture
def triton_call_counts(monkeypatch):
    counts = dict.fromkeys(KERNELS, 0)
    for name in KERNELS:
        original = getattr(triton_ops, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_ops, name, spy)
    yield counts
    ops.set_backend(None)


def _generate(path, backend: str, prompts, max_tokens):
    ops.set_backend(backend)
    # a 24-token step budget chunks the 40-token prompt and mixes prefill with decode
    llm = LLM(str(path), num_kv_blocks=32, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, [params] * len(prompts))]


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "phi3"])  # gemma2: window 32, softcaps
def test_greedy_tokens_unchanged_with_triton_kernels(make_ckpt, triton_call_counts, family):
    path = make_ckpt(family)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 17, 40)]
    reference_tokens = _generate(path, "reference", prompts, 6)
    assert not any(triton_call_counts.values())
    triton_tokens = _generate(path, "triton", prompts, 6)
    assert all(triton_call_counts.values()), triton_call_counts  # every kernel really ran
    assert triton_tokens == reference_tokens
    assert triton_tokens[1] == hf_greedy(path, prompts[1], 6)


def test_engine_fidelity_suite_passes_with_triton_kernels(make_ckpt, triton_call_counts):
    ops.set_backend("triton")
    test_fidelity.test_greedy_matches_transformers_with_chunking_prefix_hits_and_preemption(make_ckpt, "llama")
    assert all(triton_call_counts.values()), triton_call_counts
