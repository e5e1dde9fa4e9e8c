"""Verification of drafts runs each speculating sequence as a chunk of 1 + k query tokens over
its paged prefix (the prefill attention path). Greedy tokens with speculation, through the
Triton kernels (the interpreter here, the GPU elsewhere) and the CPU native ones, equal the
tokens without speculation."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.kernels import ops, triton_ops
from tests.engine.test_spec_decode_exact import NGRAM, copy_heavy


def _generate(path, backend: str | None, device, speculative_config=None):
    ops.set_backend(backend)
    try:
        llm = LLM(str(path), num_kv_blocks=32, max_num_batched_tokens=32, device=str(device), cuda_graphs=False,
                  speculative_config=speculative_config)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([copy_heavy(1, 10, 3), copy_heavy(2, 8, 2)], params)
        stats = llm.engine.speculator.stats if llm.engine.speculator is not None else None
        return [o.token_ids for o in outs], stats
    finally:
        ops.set_backend(None)


@pytest.mark.parametrize("backend", ["triton", "native"])
def test_verification_chunks_give_the_tokens_of_plain_decoding(make_ckpt, device, monkeypatch, backend):
    if backend == "native" and device.type != "cpu":
        pytest.skip("the native kernels are the CPU's")
    path = make_ckpt("llama")
    want, _ = _generate(path, "reference", device)
    chunks = []
    original = triton_ops.paged_prefill_attention

    def spy(q, *args, **kwargs):
        chunks.append(q.shape[0])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "paged_prefill_attention", spy)
    got, stats = _generate(path, backend, device, NGRAM)
    assert got == want
    assert stats.num_accepted_tokens > 0
    if backend == "triton":
        assert chunks  # the prefill kernel ran the verification chunks
