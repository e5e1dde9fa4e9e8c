"""Speculation on every path a request takes: structured outputs (a draft the grammar forbids
is rejected, the grammar never runs ahead of the accepted tokens), a prefill on another
engine whose KV is handed over, a migration that resumes token-exact (greedy and seeded),
tensor parallelism, and bad configs refused in one line."""

import json
import subprocess
import sys

import jsonschema
import pytest

from splitserve.core.speculative import SpeculativeConfigError, parse_speculative_config
from splitserve.core.structured import StructuredSpec
from splitserve.engine import LLM, SamplingParams
from tests.engine.test_disaggregation_handoff import drain, handoff
from tests.engine.test_spec_decode_exact import NGRAM, accepted, copy_heavy

ROWS = {"type": "array", "minItems": 4, "maxItems": 4,
        "items": {"type": "object", "additionalProperties": False, "required": ["name", "id"],
                  "properties": {"name": {"type": "string", "maxLength": 3}, "id": {"type": "integer", "minimum": 0, "maximum": 99}}}}


@pytest.fixture(scope="module")
def path(make_ckpt):
    return str(make_ckpt("llama"))


@pytest.fixture(scope="module")
def base(path):
    return LLM(path, num_kv_blocks=128)


@pytest.fixture(scope="module")
def spec(path):
    return LLM(path, num_kv_blocks=128, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def draft_spec(path):
    """method draft_model, the target as its own draft"""
    return LLM(path, num_kv_blocks=128, speculative_config={"method": "draft_model", "model": path,
                                                           "num_speculative_tokens": 3})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_structured_outputs_equal_without_speculation_and_match_the_schema(base, request, method):
    spec = request.getfixturevalue("spec" if method == "ngram" else "draft_spec")
    prompts = [copy_heavy(s, 12, 2) for s in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=200, structured=StructuredSpec.json_schema(ROWS)),
              SamplingParams(temperature=1.0, seed=4, max_tokens=200, structured=StructuredSpec.json_schema(ROWS)),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=200,
                             structured=StructuredSpec("regex", r"(ab|cd){6,9}x"))]
    before = accepted(spec)
    want, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert accepted(spec) > before  # the repeated keys were drafted and accepted
    for out in got[:2]:
        jsonschema.validate(json.loads(out.text), ROWS)
        assert out.finish_reason == "stop"
    assert got[2].text.endswith("x") and got[2].finish_reason == "stop"


def test_a_draft_the_grammar_forbids_is_rejected(path):
    """Drafts that copy the prompt ("a", "b") where the grammar demands digits."""
    spec = LLM(path, num_kv_blocks=64, speculative_config=NGRAM)
    proposed = []
    propose = spec.engine.speculator.propose
    spec.engine.speculator.propose = lambda *a: proposed.append(propose(*a)) or proposed[-1]
    prompt = spec.tokenizer.encode("12ab12ab12ab12ab1")
    params = SamplingParams(temperature=0, max_tokens=60, structured=StructuredSpec("regex", r"[0-9]{20}"))
    out = spec.generate(prompt, params)[0]
    assert len(out.text) == 20 and out.text.isdigit()
    forbidden = [d for drafts in proposed for d in drafts if not spec.tokenizer.decode([d]).strip().isdigit()]
    assert forbidden  # drafts the grammar forbids were proposed, and none got into the output


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, top_k=4, seed=123, max_tokens=40, ignore_eos=True),
])
def test_decode_engine_speculates_once_the_prefilled_kv_arrives(path, base, params):
    prefill = LLM(path, num_kv_blocks=64).engine
    decode = LLM(path, num_kv_blocks=64, speculative_config=NGRAM)
    prompts = [copy_heavy(7, 20, 3), copy_heavy(8, 30, 2)]
    want = base.generate(prompts, params)
    for i, prompt in enumerate(prompts):
        handoff(prefill, decode.engine, f"r{i}", prompt, params)
        assert drain(decode.engine)[f"r{i}"].token_ids == want[i].token_ids
    assert accepted(decode) > 0
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=4, seed=9, max_tokens=50, ignore_eos=True),
])
def test_a_migrated_request_resumes_token_exact(path, params):
    """What a decode worker gets on migration: prompt + the tokens so far, the draws done."""
    old, new = (LLM(path, num_kv_blocks=128, speculative_config=NGRAM) for _ in range(2))
    prompt = copy_heavy(11, 20, 3)
    full = old.generate(prompt, params)[0].token_ids
    assert accepted(old) > 0
    for done in (1, 17, 33):
        new.engine.add_request(f"m{done}", prompt + full[:done], params.resumed(done), num_draws_done=done)
        assert drain(new.engine)[f"m{done}"].token_ids == full[done:]
    assert accepted(new) > 0


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "unknown method 'medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min 5 is above prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown field(s) lookahead"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs "model"'),
    ({"method": "eagle", "num_speculative_tokens": 3, "model": "/nonexistent"}, "no config.json there"),
])
def test_bad_configs_are_refused_in_one_line(path, config, message):
    with pytest.raises(SpeculativeConfigError) as err:
        parse_speculative_config(config, path)
    assert message in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="num_speculative|method|field|prompt_lookup|model|config.json"):
        LLM(path, num_kv_blocks=8, speculative_config=config)


def test_a_draft_model_with_another_vocabulary_is_refused(path, make_ckpt, tmp_path):
    other = tmp_path / "draft"
    other.mkdir()
    vocab = json.loads((make_ckpt("llama") / "config.json").read_text())["vocab_size"]
    (other / "config.json").write_text(json.dumps({"vocab_size": vocab + 7}))
    with pytest.raises(SpeculativeConfigError, match=f"vocab_size {vocab + 7}, the target model {vocab}"):
        parse_speculative_config({"method": "draft_model", "model": str(other), "num_speculative_tokens": 3}, path)
    (other / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    config = parse_speculative_config({"method": "draft_model", "model": str(other), "num_speculative_tokens": 3},
                                      path)
    assert (config.method, config.model) == ("draft_model", str(other))
    with pytest.raises(SpeculativeConfigError, match="'eagle' is not built yet"):
        parse_speculative_config({"method": "eagle", "model": str(other), "num_speculative_tokens": 3}, path)


@pytest.mark.parametrize("command", ["serve", "decode-worker"])
def test_serve_and_the_decode_worker_refuse_a_bad_config_before_starting(path, command):
    extra = ["--redis-url", "redis://127.0.0.1:1"] if command == "decode-worker" else []
    run = subprocess.run([sys.executable, "-m", "splitserve.cli", command, "--model", path, *extra,
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -2}'],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"splitserve {command}: --speculative-config: num_speculative_tokens must be a positive integer, got -2"]


def test_tensor_parallel_ranks_verify_the_same_chunks(path, base):
    """TP=2 (gloo): rank 0 broadcasts the step with its 1 + k rows; tokens equal TP=1's without speculation."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [copy_heavy(1, 12, 3), copy_heavy(2, 20, 2)]
    want = [o.token_ids for o in base.generate(prompts, params)]
    with LLM(path, num_kv_blocks=64, tensor_parallel_size=2, speculative_config=NGRAM) as tp:
        assert [o.token_ids for o in tp.generate(prompts, params)] == want
        assert accepted(tp) > 0
