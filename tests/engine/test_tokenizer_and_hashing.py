"""Tokenizer files, chat template, incremental detokenization, and the shared block hash."""

import random

from splitserve.core.hashing import block_hashes, chain_hash, hash_seed
from splitserve.core.tokenizer import IncrementalDetokenizer, Tokenizer


def test_chat_template_matches_transformers(make_ckpt):
    from transformers import AutoTokenizer

    path = make_ckpt("llama")
    ours = Tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hello there!  "}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                          add_generation_prompt=True)
    assert ours.encode("Hello world") == theirs("Hello world")["input_ids"]
    assert ours.encode_chat(messages) == theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_eos_ids_come_from_generation_config(make_ckpt):
    tok = Tokenizer(make_ckpt("llama"))
    assert set(tok.eos_token_ids) == {tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|end_of_text|>")}


def test_incremental_detokenizer_concatenates_to_full_decode(make_ckpt):
    tok = Tokenizer(make_ckpt("llama"))
    texts = ["Hello wörld — ünïcode ✓ 日本語 ok", "plain ascii text, with punctuation!"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    rng = random.Random(0)  # arbitrary ids (as a random model emits) still concatenate exactly
    ids = [rng.randrange(5, tok.vocab_size) for _ in range(200)]
    detok = IncrementalDetokenizer(tok)
    assert "".join([detok.add(t) for t in ids] + [detok.flush()]) == tok.decode(ids)


def test_block_hash_is_chained_and_pinned():
    tokens = list(range(40))
    hs = block_hashes(tokens, 16, seed=123)
    assert len(hs) == 2  # the 8-token tail is not a full block
    assert hs[0] == chain_hash(123, tokens[:16]) and hs[1] == chain_hash(hs[0], tokens[16:32])
    # Continuing a chain gives the same hashes as computing it whole.
    assert block_hashes(tokens, 16, seed=123, start_parent=hs[0], start_block=1) == hs[1:]
    # Pinned values: router and workers in different versions must agree; change on purpose only.
    assert hash_seed("demo") == hash_seed("demo") != hash_seed("demo", "tenant-a")
    assert chain_hash(0, [1, 2, 3]) == 0x4D64EDB81A1F5640
    assert hash_seed("demo") == 0x37F56639F1D2DA03
