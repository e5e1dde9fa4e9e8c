"""Tokenizer files, chat template, incremental detokenization, and the shared block hash."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.core.hashing import block_hashes, chain_hash, hash_seed
from splitserve.core.tokenizer import IncrementalDetokenizer, Tokenizer, _byte_level_chars


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


def _byte_ids(tok: Tokenizer) -> dict[int, int]:
    table = _byte_level_chars()
    return {b: tok.token_to_id(table[b]) for b in range(256)}


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.add(t) for t in ids] + [detok.flush()]


def test_byte_level_stream_holds_back_only_a_character_being_written(make_ckpt):
    """Invalid bytes (as a random or broken model emits) reach the client at once as U+FFFD;
    only the start of a character that later bytes may complete is held. Before, a stream
    ending in U+FFFD was held whole, so such a request streamed nothing until its end."""
    tok = Tokenizer(make_ckpt("llama"))
    assert tok.continuation_byte_ids is not None
    b = _byte_ids(tok)
    ids = [b[0x80], b[0x80], b[0xE4], b[0xB8], b[0x80], b[0xC3], b[0xE4], b[0xE4], b[0x41], b[0xF0], b[0x9F]]
    pieces = _stream(tok, ids)
    assert pieces == ["\ufffd", "\ufffd", "", "", "\u4e00", "", "\ufffd", "\ufffd", "\ufffdA", "", "", "\ufffd"]
    assert "".join(pieces) == tok.decode(ids)


def test_a_run_of_broken_characters_keeps_the_decoded_window_short(make_ckpt, monkeypatch):
    """A model stuck on one lead byte (as random or broken models get stuck on a token) writes a
    character that never completes, again and again: each is sent as U+FFFD once the next one
    starts, and no token decodes more than a few tokens (the window once grew with the run, so
    every token cost more than the one before it)."""
    tok = Tokenizer(make_ckpt("llama"))
    lead = _byte_ids(tok)[0xE4]
    decoded_lengths: list[int] = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded_lengths.append(len(ids)) or decode(ids, **kw))
    pieces = _stream(tok, [lead] * 500)
    assert pieces[:3] == ["", "\ufffd", "\ufffd"] and "".join(pieces) == "\ufffd" * 500
    assert max(decoded_lengths) <= 6


def test_byte_fallback_tokenizer_keeps_holding_replacement_text(tmp_path):
    """SentencePiece's byte fallback turns every byte of an invalid run into U+FFFD, so a
    later byte can still change earlier replacement characters: nothing ending in U+FFFD is
    released before it decodes cleanly (vLLM's rule), and the text still adds up."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "\u2581a": 1, "b": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    tok = Tokenizer(tmp_path)
    assert tok.continuation_byte_ids is None
    byte = {i: 3 + i for i in range(256)}
    ids = [byte[0x80], byte[0xE4], byte[0xB8], byte[0x80], 2]
    pieces = _stream(tok, ids)
    assert pieces[:2] == ["", ""]  # held: U+FFFD at the end
    assert "".join(pieces) == tok.decode(ids)


@pytest.fixture(scope="module")
def llama_tokenizer(tmp_path_factory):
    from tests.helpers.checkpoints import make_checkpoint

    return Tokenizer(make_checkpoint(tmp_path_factory.mktemp("tok"), "llama"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_text_is_always_a_prefix_of_the_final_text(llama_tokenizer, data):
    """Whatever ids arrive (bytes of broken characters, special tokens, ordinary tokens):
    what was handed out is never taken back, at most the character being written is held,
    and the pieces add up to the full decode."""
    tok = llama_tokenizer
    b = _byte_ids(tok)
    token = st.one_of(st.sampled_from([b[x] for x in (0x80, 0x8F, 0x90, 0xA0, 0xBF, 0xC3, 0xE0, 0xE4, 0xED,
                                                      0xF0, 0xF4, 0xFF, 0x41)]),
                      st.integers(0, tok.vocab_size - 1))
    ids = data.draw(st.lists(token, min_size=1, max_size=40))
    detok, sent = IncrementalDetokenizer(tok), ""
    for i, t in enumerate(ids):
        sent += detok.add(t)
        so_far = tok.decode(ids[: i + 1])
        assert so_far.startswith(sent)
        assert len(so_far) - len(sent) <= 1, (ids[: i + 1], so_far, sent)
    assert sent + detok.flush() == tok.decode(ids)


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
