"""EngineConfig.delta_outputs (what a serving worker's engine runs with): each output carries
this step's part only, and the parts add up to what a cumulative engine reports, token for
token, character for character, logprob for logprob, with the same finish reasons."""

from __future__ import annotations

from splitserve.core.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine

REQUESTS = {  # greedy with logprobs, a stop string met mid-output, seeded sampling, a length cut
    "greedy": SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True),
    "stopped": SamplingParams(temperature=0, max_tokens=12, stop=[" value"], ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=7, max_tokens=12),
    "short": SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
}
PROMPTS = {"greedy": "the quick brown fox", "stopped": "the quick brown fox", "seeded": "a b c d e f",
           "short": "hello"}


def _run(ckpt, delta: bool) -> dict[str, list]:
    engine = LLMEngine(EngineConfig(model=str(ckpt), num_kv_blocks=64, delta_outputs=delta))
    for rid, params in REQUESTS.items():
        engine.add_request(rid, PROMPTS[rid], params)
    outputs: dict[str, list] = {rid: [] for rid in REQUESTS}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_delta_outputs_add_up_to_the_cumulative_ones(make_ckpt):
    ckpt = make_ckpt("llama")
    cumulative, delta = _run(ckpt, False), _run(ckpt, True)
    for rid in REQUESTS:
        last = cumulative[rid][-1]
        parts = delta[rid]
        assert [o.new_token_ids for o in parts] == [o.new_token_ids for o in cumulative[rid]]
        assert sum((o.new_token_ids for o in parts), []) == last.token_ids
        assert "".join(o.new_text for o in parts) == last.text
        assert [lp for o in parts for lp in o.new_logprobs] == last.logprobs
        assert (parts[-1].finished, parts[-1].finish_reason) == (True, last.finish_reason)
        assert [o.finished for o in parts[:-1]] == [False] * (len(parts) - 1)
        # nothing cumulative is copied into a delta output: not the prompt, not the output so far
        assert all(o.prompt_token_ids == [] and o.token_ids == [] and o.logprobs == [] and o.text == ""
                   for o in parts)
    assert cumulative["greedy"][-1].logprobs and cumulative["short"][-1].finish_reason == "length"
    assert cumulative["stopped"][-1].finish_reason == "stop" and len(cumulative["stopped"]) > 2
    assert len(cumulative["greedy"][-1].prompt_token_ids) > 1
