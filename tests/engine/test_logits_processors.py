"""Penalties, logit_bias and min_tokens against transformers' logits processors (and, for
OpenAI's presence/frequency penalties, which transformers lacks, OpenAI's documented
formula): on fixed logits, and end to end (greedy, token-exact vs generate with the same
processors, in the same order)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.logits_processors import apply_logits_processors
from splitserve.engine.sequence import Sequence
from tests.helpers.reference import hf_model

VOCAB = 50
EOS = 3


class OpenAIPenalties(LogitsProcessor):
    """logit[t] -= frequency * count(t in output) + presence * (count > 0) (OpenAI's docs)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids):
            counts = torch.bincount(ids[self.prompt_len:], minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def reference_processors(prompt_len: int, p: SamplingParams) -> LogitsProcessorList:
    """The engine's order (vLLM's): logit_bias, min_tokens, repetition, frequency/presence."""
    procs = []
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}))
    if p.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, [EOS]))
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, p.presence_penalty, p.frequency_penalty))
    return LogitsProcessorList(procs)


PARAMS = {
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=-0.7),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "logit_bias": SamplingParams(logit_bias={4: 30.0, 9: -100.0, 11: 0.5}),
    "min_tokens": SamplingParams(min_tokens=8),
    "all": SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2,
                          logit_bias={4: 3.0, 7: -2.0}, min_tokens=10),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_fixed_logits_match_the_reference_processors(name):
    p = PARAMS[name]
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(12)]
    output = [rng.choice([4, 5, 5, 9, 11, 20]) for _ in range(6)]  # repeats, and tokens also in the prompt
    seq = Sequence("r", prompt + output, len(prompt), p, 1000)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    got = apply_logits_processors(logits, [seq], {EOS})
    want = reference_processors(len(prompt), p)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.equal(got, logits)  # each case changes something
    untouched = Sequence("u", prompt, len(prompt), SamplingParams(), 1000)
    assert apply_logits_processors(logits, [untouched], {EOS}) is logits


def test_a_resumed_request_counts_its_earlier_output_but_not_its_prompt():
    """After a migration the tokens generated elsewhere arrive inside the prompt."""
    p = SamplingParams(presence_penalty=2.0)
    prompt, earlier = [1, 2, 3], [7, 7]
    seq = Sequence("r", prompt + earlier, len(prompt) + len(earlier), p, 100)
    seq.num_resumed_tokens = len(earlier)
    out = apply_logits_processors(torch.zeros(1, VOCAB), [seq], set())
    assert out[0, 7] == -2.0 and out[0, 1] == 0.0


@pytest.fixture(scope="module")
def llm_and_path(make_ckpt):
    path = make_ckpt("llama")
    return LLM(str(path), num_kv_blocks=64), path


@pytest.mark.parametrize("name", list(PARAMS))
def test_greedy_tokens_match_generate_with_the_same_processors(llm_and_path, name):
    llm, path = llm_and_path
    eos = llm.engine.eos_token_ids
    rng = random.Random(2)
    prompt = [rng.randrange(5, 60) for _ in range(20)]  # few distinct ids: repetition penalties bite
    base = PARAMS[name]
    bias = {t + 100: b for t, b in base.logit_bias.items()}
    if name == "min_tokens":  # this random model never says EOS by itself: make it want to at once
        bias = {min(eos): 40.0}
    params = SamplingParams(**{**base.__dict__, "temperature": 0, "max_tokens": 24, "logit_bias": bias})
    out = llm.generate([prompt], params)[0]
    model = hf_model(str(path))
    procs = reference_processors(len(prompt), params)
    for proc in procs:  # min_tokens bans this checkpoint's EOS ids, not the fixed-logits EOS
        if isinstance(proc, MinNewTokensLengthLogitsProcessor):
            proc.eos_token_id = torch.tensor(sorted(eos))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             logits_processor=procs, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
    want = ref[0, len(prompt):].tolist()
    if want and want[-1] in eos:  # generate stops at EOS like the engine does
        assert out.finish_reason == "stop"
    assert out.token_ids == want
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                  logit_bias=bias if name == "min_tokens" else {}))[0]
    assert plain.token_ids != out.token_ids, "the processors changed nothing on this prompt"
    if name == "min_tokens":
        assert len(plain.token_ids) == 1 and len(out.token_ids) == 9 and out.finish_reason == "stop"
