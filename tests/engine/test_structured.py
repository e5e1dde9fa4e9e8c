"""Structured outputs in the engine: constrained sequences match their schema on every path
(one engine, a prefill/decode hand-off, a prefix-cache hit, a migration rebuilt from the
tokens so far), EOS only where the grammar is complete, unconstrained rows untouched, one
compilation per schema."""

import json
import random

import jsonschema
import pytest
import torch

from splitserve.core.structured import StructuredSpec
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.grammar import BatchMask, apply_mask
from splitserve.engine.llm_engine import InvalidPromptError
from tests.engine.test_disaggregation_handoff import drain, handoff

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                  "minItems": 2, "maxItems": 3}}}
SPEC = StructuredSpec.json_schema(PERSON)


def prompts(n, seed=3, length=20):
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length + i)] for i in range(n)]


def constrained(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 200, "structured": SPEC, **kw})


@pytest.fixture(scope="module")
def path(make_ckpt):
    return str(make_ckpt("llama"))


def test_constrained_rows_match_the_schema_and_unconstrained_rows_are_untouched(path):
    llm = LLM(path, num_kv_blocks=256)
    batch = prompts(4)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(batch, free)
    mixed = llm.generate(batch * 2, [free] * 4 + [constrained(), constrained(temperature=1.0, seed=5),
                                                  constrained(temperature=0.7, top_p=0.9, seed=6),
                                                  constrained(temperature=1.0, seed=7, presence_penalty=1.0)])
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    for out in mixed[4:]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
        assert not set(out.token_ids) & llm.engine.eos_token_ids  # ended by the grammar, no EOS emitted
    assert llm.engine.grammars.compilations == 1  # one schema, compiled once


def test_choice_regex_and_grammar_outputs(path):
    llm = LLM(path, num_kv_blocks=128)
    batch = prompts(3, seed=4)
    cases = [(StructuredSpec.choice(["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
             (StructuredSpec("regex", r"[0-9]{3}-[a-c]{2}"),
              lambda t: len(t) == 6 and t[:3].isascii() and t[:3].isdigit() and t[3] == "-" and set(t[4:]) <= set("abc")),
             (StructuredSpec("grammar", 'root ::= "(" [xy]+ ")"'),  # GBNF, as vLLM's guided_grammar takes it
              lambda t: t.startswith("(") and t.endswith(")") and set(t[1:-1]) <= {"x", "y"} and len(t) > 2)]
    for spec, ok in cases:
        outs = llm.generate(batch, SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured=spec))
        for out in outs:
            assert out.finish_reason in ("stop", "length") and (out.finish_reason == "length" or ok(out.text)), \
                (spec, out.text)
        assert any(out.finish_reason == "stop" for out in outs), spec


def test_eos_is_allowed_only_when_the_grammar_is_complete(path):
    llm = LLM(path, num_kv_blocks=16)
    grammars, tok = llm.engine.grammars, llm.engine.tokenizer
    eos = sorted(llm.engine.eos_token_ids)
    a = tok.encode("a", add_special_tokens=False)
    assert len(a) == 1
    matcher = grammars.matcher(StructuredSpec("regex", "a+"))

    def allowed(m) -> set[int]:
        mask = grammars.start_masks([None, m]).result()
        assert mask.rows == [1] and (mask.bitmask[0] == -1).all()  # the unconstrained row: nothing computed
        bits = ((mask.bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
        return set(torch.nonzero(bits).flatten().tolist())

    before = allowed(matcher)
    assert a[0] in before and not before & set(eos)
    assert matcher.consume_token(a[0])
    assert set(eos) <= allowed(matcher)


def test_apply_mask_sets_exactly_the_disallowed_tokens_of_masked_rows():
    logits = torch.randn(3, 70)
    bitmask = torch.full((3, 3), -1, dtype=torch.int32)
    bitmask[2] = 0
    bitmask[2, 0] = 1 << 5
    bitmask[2, 2] = 1 << 1  # token 65
    out = apply_mask(logits, BatchMask([2], bitmask), copy=True)
    assert torch.equal(out[:2], logits[:2])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [5, 65]
    assert out[2, 5] == logits[2, 5] and out[2, 65] == logits[2, 65]
    assert torch.isfinite(logits).all()  # copy=True left the input alone


@pytest.mark.parametrize("params", [constrained(), constrained(temperature=1.0, seed=21)])
def test_prefill_here_decode_there_and_a_prefix_hit_give_the_same_constrained_output(path, params):
    single = LLM(path, num_kv_blocks=64)
    prefill, decode = LLM(path, num_kv_blocks=64).engine, LLM(path, num_kv_blocks=64).engine
    prompt = prompts(1, seed=8, length=40)[0]
    expected = single.generate([prompt], params)[0]
    jsonschema.validate(json.loads(expected.text), PERSON)
    for rid in ("r0", "r1"):  # r1: the prompt's blocks are cached on both sides
        slot = handoff(prefill, decode, rid, prompt, params)
        out = drain(decode)[rid]
        assert out.token_ids == expected.token_ids and out.finish_reason == "stop"
    assert slot.num_cached_tokens == 32
    again = single.generate([prompt], params)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == expected.token_ids


def test_a_migrated_request_rebuilds_its_grammar_from_the_tokens_so_far(path):
    llm = LLM(path, num_kv_blocks=64)
    prompt = prompts(1, seed=9)[0]
    params = constrained(temperature=1.0, seed=31)
    full = llm.generate([prompt], params)[0]
    k = len(full.token_ids) // 2
    assert k >= 5
    engine = llm.engine
    engine.add_request("moved", prompt + full.token_ids[:k], params.resumed(k), num_draws_done=k)
    rest = drain(engine)["moved"]
    assert rest.token_ids == full.token_ids[k:] and rest.finish_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(full.token_ids[:k] + rest.token_ids)), PERSON)

    wrong = engine.tokenizer.encode("[1,2]", add_special_tokens=False)
    with pytest.raises(InvalidPromptError, match="resumed tokens do not match the json_schema"):
        engine.add_request("bad", prompt + wrong, params.resumed(len(wrong)), num_draws_done=len(wrong))


def test_a_spec_that_does_not_compile_is_an_invalid_request(path):
    engine = LLM(path, num_kv_blocks=16).engine
    bad = StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}})
    with pytest.raises(InvalidPromptError, match="invalid json_schema \\(response_format\\): .*strin"):
        engine.add_request("x", [5, 6, 7], SamplingParams(structured=bad))
    assert not engine.has_unfinished_requests()


def test_a_tokenizer_llguidance_cannot_read_refuses_constrained_requests_only():
    from splitserve.engine.grammar import GrammarCompiler, GrammarError

    compiler = GrammarCompiler('{"model": {"type": "NoSuchModel"}}', 64, [1])
    assert compiler.start_masks([None, None]) is None  # unconstrained batches go on
    with pytest.raises(GrammarError, match="structured outputs are unavailable with this model's tokenizer"):
        compiler.matcher(SPEC)
