"""gpt-oss's MXFP4 twin (test_gpt_oss_mxfp4.py) over two tensor-parallel ranks: each rank holds
every expert's half of the intermediate pairs, cut from the QuantizedWeights exactly (gate_up's
rows 2I/2, down's input columns I/2 = one 32-column MXFP4 group, so intermediate_size 64 here);
and under expert parallelism 4 of the 8 experts whole. Greedy tokens equal transformers'
loading the same checkpoint dequantised (float32)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.gpt_oss_quant import QuantizedGptOssExperts
from tests.engine.test_gpt_oss import NEW_TOKENS, prompts, write_gpt_oss
from tests.engine.test_gpt_oss_mxfp4 import transformers_dequantized, write_mxfp4_twin


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4_tp")
    return write_mxfp4_twin(write_gpt_oss(root / "float", intermediate_size=64), root / "mxfp4")


@pytest.fixture(scope="module")
def reference(twin):
    model = transformers_dequantized(twin)
    ps = prompts(model.config.vocab_size)
    outs = []
    for prompt in ps:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(prompt):].tolist())
    return ps, outs


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp2_mxfp4_greedy_tokens_equal_transformers_dequantised(twin, reference, expert_parallel):
    ps, want = reference
    with LLM(str(twin), num_kv_blocks=64, max_num_batched_tokens=32, tensor_parallel_size=2,
             enable_expert_parallel=expert_parallel) as llm:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        assert isinstance(experts, QuantizedGptOssExperts)
        (gate_up,), (down,) = experts.gate_up[0].parts, experts.down[0].parts
        assert (experts.num_experts, gate_up.out_features, down.in_features) == \
            ((4, 128, 64) if expert_parallel else (8, 64, 32))
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out, tokens in zip(ps, outs, want, strict=True):
        assert out.token_ids == tokens, f"prompt of {len(prompt)} tokens"
