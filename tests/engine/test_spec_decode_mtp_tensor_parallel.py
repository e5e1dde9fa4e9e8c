"""The "mtp" method under tensor parallelism (2 gloo ranks): rank 0 runs the MTP layer whole,
alone, on the hidden states of its own shard of the target (the residual stream is whole on
every rank). Greedy tokens equal transformers float32 and most drafts are kept (the MTP
layer that reproduces the model, tests/engine/test_spec_decode_mtp.py). Slow: tests/suite/plan.py."""

from __future__ import annotations

from splitserve.engine import LLM
from tests.engine.test_deepseek_v3 import NEW_TOKENS, prompts
from tests.engine.test_spec_decode_mtp import GREEDY, MTP, write_mtp_checkpoint
from tests.helpers.reference import hf_greedy


def test_mtp_at_tp_2_equals_transformers_and_keeps_most_drafts(tmp_path):
    ckpt = str(write_mtp_checkpoint(tmp_path / "deepseek_v3_mtp", "deepseek_v3", reproduces=True))
    llm = LLM(ckpt, num_kv_blocks=64, tensor_parallel_size=2, speculative_config=MTP)
    try:
        ps = prompts(llm.engine.model_config.vocab_size)
        assert [o.token_ids for o in llm.generate(ps, GREEDY)] == [hf_greedy(ckpt, p, NEW_TOKENS) for p in ps]
        stats = llm.engine.speculator.stats
        assert stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens > 0, vars(stats)
    finally:
        llm.engine.close()
