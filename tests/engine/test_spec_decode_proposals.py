"""Where drafts come from and how many: prompt lookup (longest n-gram first, its latest
occurrence), the speculator's caps (max_tokens, the context, disable_by_batch_size, held
prefill requests), and the scheduler's (drafts never starve a sequence of its decode step)."""

import pytest

from splitserve.core.sampling_params import SamplingParams
from splitserve.core.speculative import SpeculativeConfig
from splitserve.engine import LLM
from splitserve.engine.sequence import Sequence
from splitserve.engine.spec.ngram import propose_ngram
from splitserve.engine.spec.speculator import Speculator
from tests.engine.test_spec_decode_exact import NGRAM, copy_heavy


def test_prompt_lookup_takes_the_longest_ngram_and_its_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 9, 9, 2, 3, 7, 8, 6, 5, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [7, 8, 6]  # "2 3" last seen at 5: what followed it
    assert propose_ngram(tokens, 3, 3, 3) == []  # "5 2 3" never came before
    assert propose_ngram([4, 1, 2, 3, 5, 6, 1, 2, 3], 2, 1, 3) == [5, 6]  # "1 2 3" beats the later "3"
    assert propose_ngram([7, 7, 7, 7], 3, 1, 2) == [7]  # a periodic tail: the only occurrence with a follower
    assert propose_ngram([1, 2, 3, 1, 2], 0, 1, 2) == []
    assert propose_ngram([5], 4, 1, 3) == []


def seq(tokens: int, prompt: int, max_tokens: int | None, max_total: int = 1000) -> Sequence:
    ids = copy_heavy(1, 10, 4)[:tokens]
    return Sequence("r", ids, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), max_total)


@pytest.mark.parametrize("max_tokens, max_total, room, want", [
    (None, 1000, 99, 4),  # k
    (None, 1000, 2, 2),  # what the step leaves
    (10, 1000, 99, 4),  # 30 prompt + 5 output tokens: 5 left, so 4 drafts and a bonus token
    (7, 1000, 99, 1),  # 2 left: 1 draft + 1 bonus
    (6, 1000, 99, 0),  # 1 left: nothing to speculate
    (None, 38, 99, 2),  # the context: 35 tokens + 2 drafts + 1 = 38
])
def test_the_speculator_never_drafts_past_what_the_request_may_produce(max_tokens, max_total, room, want):
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 3))
    assert len(spec.propose(seq(35, 30, max_tokens, max_total), room, batch_size=1)) == want


def test_disable_by_batch_size_and_held_requests_get_no_drafts():
    spec = Speculator(SpeculativeConfig("ngram", 4, 1, 3, disable_by_batch_size=8))
    s = seq(35, 30, None)
    assert len(spec.propose(s, 99, batch_size=8)) == 4
    assert spec.propose(s, 99, batch_size=9) == []
    s.hold_kv = True  # a prefill worker's request: it produces one token and is pushed
    assert spec.propose(s, 99, batch_size=1) == []


def test_drafts_never_take_the_step_a_running_sequence_needs(make_ckpt):
    """A 16-token step budget and 12 decoding sequences: each still gets its token every
    step; drafts only use what is left."""
    llm = LLM(str(make_ckpt("llama")), num_kv_blocks=128, max_num_batched_tokens=16,
              speculative_config={**NGRAM, "num_speculative_tokens": 8})
    engine = llm.engine
    for i in range(12):
        engine.add_request(f"r{i}", copy_heavy(i, 6, 2), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(
            engine.scheduler.waiting)):
        engine.step()
    verified = 0
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        batch_before = engine.speculator.stats.num_draft_tokens
        outputs = engine.step()
        assert len(outputs) == running  # every running sequence got its step
        verified += engine.speculator.stats.num_draft_tokens - batch_before
        assert engine.speculator.stats.num_draft_tokens - batch_before <= 16 - running
    assert verified > 0 and engine.speculator.stats.num_accepted_tokens > 0
    assert engine.num_free_blocks == engine.num_total_blocks
