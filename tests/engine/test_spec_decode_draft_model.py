"""The draft_model method: a second model proposes, the target verifies. Greedy outputs equal
the outputs without speculation token for token (the target itself as its own draft, a
1-layer model, a perturbed copy), sampled outputs follow the target's distribution (chi-square
against sampling without speculation, with drafts both kept and rejected), seeded requests
give the tokens of sampling without speculation, the draft model rebuilds its KV on a decode engine after a remote prefill,
its pool gets every block back, and it runs in the step's propose phase, not inside the scheduler."""

import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_disaggregation_handoff import drain, handoff
from tests.engine.test_spec_decode_exact import accepted, copy_heavy
from tests.engine.test_spec_decode_sampling import chi_square_quantile, two_sample_chi_square

PROMPTS = [copy_heavy(1, 12, 3), copy_heavy(2, 20, 2), copy_heavy(3, 7, 2)]


@pytest.fixture(scope="module")
def drafts(make_ckpt, tmp_path_factory):
    """target, and drafts by name: itself, a 1-layer model, a copy with a perturbed LM head."""
    target = make_ckpt("llama")
    near = tmp_path_factory.mktemp("near-draft")
    shutil.copytree(target, near, dirs_exist_ok=True)
    weights = load_file(near / "model.safetensors")
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = head + 0.15 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(3))
    save_file(weights, str(near / "model.safetensors"), metadata={"format": "pt"})
    return str(target), {"self": str(target), "small": str(make_ckpt("llama", num_hidden_layers=1)), "near": str(near)}


def engine(target: str, draft: str, k: int = 3, **kw) -> LLM:
    return LLM(target, num_kv_blocks=96, speculative_config={"method": "draft_model", "model": draft,
                                                            "num_speculative_tokens": k}, **kw)


@pytest.mark.parametrize("name", ["self", "small", "near"])
def test_greedy_outputs_equal_without_speculation(drafts, name):
    target, by_name = drafts
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    want = LLM(target, num_kv_blocks=96).generate(PROMPTS, params)
    spec = engine(target, by_name[name])
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [lp.token_id for lp in got[0].logprobs] == got[0].token_ids
    stats = spec.engine.speculator.stats
    if name != "small":  # (a 1-layer random model rarely agrees with the target)
        assert stats.num_accepted_tokens > stats.num_draft_tokens // 3
    if name == "self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens  # the target agrees with itself
    spec.engine.speculator.release_finished()
    assert spec.engine.num_free_blocks == 96
    assert spec.engine.speculator.draft.blocks.num_free_blocks == spec.engine.speculator.draft.blocks.num_blocks


def test_sampled_outputs_follow_the_target_distribution(drafts):
    target, by_name = drafts
    base, spec = LLM(target, num_kv_blocks=512, max_num_seqs=128), engine(target, by_name["near"], k=2,
                                                                          max_num_seqs=128)
    prompt = copy_heavy(21, 16, 2)

    def samples(llm, seeds):
        params = [SamplingParams(temperature=1.0, top_k=2, seed=s, max_tokens=3, ignore_eos=True) for s in seeds]
        return Counter(tuple(o.token_ids) for o in llm.generate([prompt] * len(params), params))

    plain, speculative = samples(base, range(500)), samples(spec, range(10_000, 10_500))
    stats = spec.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts kept and rejected
    statistic, df = two_sample_chi_square(plain, speculative)
    assert df >= 3 and statistic < chi_square_quantile(df, 3.09), (statistic, df)
    seeds = range(40)  # the drafts race with the noise verification draws: a seeded request's tokens are
    assert samples(spec, seeds) == samples(spec, seeds) == samples(base, seeds)  # those without speculation


def test_seeded_sampling_with_penalties_and_n_choices_equals_without_speculation(drafts):
    target, by_name = drafts
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=24, ignore_eos=True,
                             repetition_penalty=1.1, n=2, logprobs=1) for s in (3, 4, 5)]
    want = LLM(target, num_kv_blocks=96).generate(PROMPTS, params)
    spec = engine(target, by_name["near"])
    got = spec.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.choices] for o in got] == [[c.token_ids for c in o.choices] for o in want]
    assert accepted(spec) > 0


def test_the_draft_model_rebuilds_its_kv_after_a_remote_prefill(drafts):
    target, by_name = drafts
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = LLM(target, num_kv_blocks=96).generate(PROMPTS[:2], params)
    prefill, decode = LLM(target, num_kv_blocks=96).engine, engine(target, by_name["self"])
    for i, prompt in enumerate(PROMPTS[:2]):
        handoff(prefill, decode.engine, f"r{i}", prompt, params)
        assert drain(decode.engine)[f"r{i}"].token_ids == want[i].token_ids
    assert accepted(decode) > 0


def test_the_draft_model_runs_in_the_propose_phase_never_inside_schedule(drafts):
    """Propose, then schedule: the draft model's forward passes come before Scheduler.schedule,
    which only accounts for the drafts attached (a draft pass inside it raises here)."""
    target, by_name = drafts
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(target, num_kv_blocks=96).generate(PROMPTS, params)
    spec = engine(target, by_name["self"])
    scheduler, draft = spec.engine.scheduler, spec.engine.speculator.draft.runner
    schedule, execute, scheduling, passes = scheduler.schedule, draft.execute, [], []

    def schedule_step():
        scheduling.append(True)
        try:
            return schedule()
        finally:
            scheduling.pop()

    def draft_pass(step):
        if scheduling:
            raise AssertionError("a draft model forward pass inside Scheduler.schedule()")
        passes.append(step)
        return execute(step)

    scheduler.schedule, draft.execute = schedule_step, draft_pass
    got = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert passes and accepted(spec) == spec.engine.speculator.stats.num_draft_tokens > 0
