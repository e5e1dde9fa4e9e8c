"""The offline o200k vocabulary for openai-harmony (core/harmony_vocab.py): rebuilt from
quicktok-v1 only when it hashes to the published file, never used otherwise."""

from __future__ import annotations

import hashlib
import struct

import pytest

from splitserve.core import harmony_vocab as hv


def test_the_command_writes_the_published_file_and_says_what_to_export(tmp_path, capsys):
    assert hv.main([str(tmp_path)]) == 0
    data = (tmp_path / hv.O200K_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == hv.O200K_SHA256
    assert len(data.splitlines()) == 199_998  # o200k_base's ranks (the specials are harmony's own)
    assert capsys.readouterr().out == f"export TIKTOKEN_ENCODINGS_BASE={tmp_path}\n"


def test_a_vocabulary_off_by_one_token_is_refused_and_nothing_is_written(tmp_path, monkeypatch, capsys):
    real = hv._quicktok_vocab()
    count, off = struct.unpack_from("<I", real, 0)[0], 4
    (length,) = struct.unpack_from("<H", real, off)
    first = real[off + 2: off + 2 + length]
    tampered = real[:off + 2] + bytes([first[0] ^ 1]) + real[off + 3:]  # one byte of the first token
    monkeypatch.setattr(hv, "_quicktok_vocab", lambda: tampered)
    assert hv.main([str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("harmony_vocab: the o200k vocabulary rebuilt from quicktok hashes to ")
    assert err.rstrip().endswith(f"not the published {hv.O200K_SHA256}: not used") and err.count("\n") == 1
    assert not (tmp_path / "v").exists()
    assert count > 199_000


def test_a_truncated_or_padded_quicktok_file_is_refused():
    one = struct.pack("<I", 1) + struct.pack("<H", 2) + b"ab" + struct.pack("<I", 7)
    assert hv.quicktok_ranks(one) == [(b"ab", 7)]
    with pytest.raises(hv.VocabUnavailable, match="3 bytes left after 1 tokens"):
        hv.quicktok_ranks(one + b"xyz")
