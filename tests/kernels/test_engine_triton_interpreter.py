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
from splitserve.kernels import ops, triton_fused, triton_ops
from tests.engine import test_fidelity
from tests.helpers.reference import hf_greedy

KERNELS = {triton_ops: ["paged_decode_attention", "paged_prefill_attention", "store_kv", "rms_norm", "apply_rotary"],
           triton_fused: ["rotary_and_store_kv", "act_and_mul", "add_rms_norm"]}
# each op of a layer ran through one of its Triton kernels (fused where the case allows)
OPS = [("paged_decode_attention",), ("paged_prefill_attention",), ("rms_norm", "add_rms_norm"),
       ("apply_rotary", "rotary_and_store_kv"), ("store_kv", "rotary_and_store_kv"), ("act_and_mul",)]


@pytest.fixture
def triton_call_counts(monkeypatch):
    counts = {name: 0 for names in KERNELS.values() for name in names}
    for module, names in KERNELS.items():
        for name in names:
            original = getattr(module, name)

            def spy(*args, _name=name, _original=original, **kwargs):
                counts[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, spy)
    yield counts
    ops.set_backend(None)


def every_op_ran(counts: dict) -> bool:
    return all(any(counts[name] for name in names) for names in OPS)


def _generate(path, backend: str, prompts, max_tokens, device):
    ops.set_backend(backend)
    # a 24-token step budget chunks the 40-token prompt and mixes prefill with decode
    # eager steps: the kernels are under test here (graphs are the GPU check's graphs stage), and
    # the reference kernels cannot be captured
    llm = LLM(str(path), num_kv_blocks=32, max_num_batched_tokens=24, device=str(device), cuda_graphs=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, [params] * len(prompts))]


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "phi3"])  # gemma2: window 32, softcaps
def test_greedy_tokens_unchanged_with_triton_kernels(make_ckpt, triton_call_counts, family, device):
    """On a GPU the engine runs there (the compiled kernels; Triton refuses CPU tensors)."""
    path = make_ckpt(family)
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 17, 40)]
    reference_tokens = _generate(path, "reference", prompts, 6, device)
    assert not any(triton_call_counts.values())
    triton_tokens = _generate(path, "triton", prompts, 6, device)
    assert every_op_ran(triton_call_counts), triton_call_counts  # every op really ran through Triton
    assert triton_tokens == reference_tokens
    assert triton_tokens[1] == hf_greedy(path, prompts[1], 6)


def test_engine_fidelity_suite_passes_with_triton_kernels(make_ckpt, triton_call_counts, device):
    if device.type == "cuda":  # the suite builds its engines on the CPU, where compiled Triton cannot run
        pytest.skip("on a GPU the engine's fidelity against transformers is the GPU check's fidelity stage")
    ops.set_backend("triton")
    test_fidelity.test_greedy_matches_transformers_with_chunking_prefix_hits_and_preemption(make_ckpt, "llama")
    assert every_op_ran(triton_call_counts), triton_call_counts


def test_mla_runs_on_the_paged_triton_kernels(tmp_path, triton_call_counts, device):
    """DeepSeek-V3's multi-head latent attention (engine/models/mla.py) is multi-query attention
    over one 40-wide latent row, the row itself the value: the GQA kernels run it unchanged
    (prefill, decode, the row's store), with the same tokens as the reference kernels."""
    from tests.engine.test_deepseek_v3 import write_deepseek_v3

    path = write_deepseek_v3(tmp_path / "deepseek_v3")
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 17, 40)]
    reference_tokens = _generate(path, "reference", prompts, 6, device)
    triton_tokens = _generate(path, "triton", prompts, 6, device)
    assert all(triton_call_counts[name] for name in ("paged_decode_attention", "paged_prefill_attention", "store_kv"))
    assert triton_tokens == reference_tokens
    assert triton_tokens[2] == hf_greedy(path, prompts[2], 6)


def test_gpt_oss_sinks_and_windows_run_on_the_triton_kernels(tmp_path, triton_call_counts, device):
    """gpt-oss (engine/models/gpt_oss.py): a sink logit per head in every softmax, an 8-token
    window on alternate layers, prompts past it and chunked: the Triton attention kernels
    (split-K decode merges the sink once) give the reference kernels' tokens and transformers'."""
    from tests.engine.test_gpt_oss import write_gpt_oss

    path = write_gpt_oss(tmp_path / "gpt_oss")
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 17, 40)]
    reference_tokens = _generate(path, "reference", prompts, 6, device)
    triton_tokens = _generate(path, "triton", prompts, 6, device)
    assert all(triton_call_counts[name] for name in ("paged_decode_attention", "paged_prefill_attention"))
    assert triton_tokens == reference_tokens
    assert triton_tokens[2] == hf_greedy(path, prompts[2], 6)
