"""A Hugging Face tokenizer with gpt-oss's vocabulary: o200k plus the harmony special tokens
(ids 199998-201087, as openai-harmony numbers them), built offline.

The ranks come from the verified o200k_base.tiktoken (splitserve/core/harmony_vocab.py) and
go through transformers' own TikTokenConverter (the converter that made gpt-oss's shipped
tokenizer.json), so text encodes here exactly as openai-harmony's encoding encodes it
(tests/router/test_harmony.py checks). Tiny gpt-oss test checkpoints reuse it:
`write_harmony_tokenizer(dir)` writes tokenizer.json, tokenizer_config.json and
generation_config's EOS ids beside a config.json.

Building the merges takes about 10 s, so the tokenizer.json is cached between runs
(tests/helpers/run_cache.py) and copied.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from pathlib import Path

from splitserve.core.harmony_vocab import O200K_SHA256, use_offline_vocab
from tests.helpers import run_cache

# openai-harmony's o200k pattern (tiktoken's o200k_base pat_str)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])
FIRST_SPECIAL, VOCAB_SIZE = 199998, 201088
NAMED_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                  200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                  200012: "<|call|>", 200018: "<|endofprompt|>"}
EOS_IDS = [200002, 199999, 200012]  # gpt-oss's generation_config: <|return|>, <|endoftext|>, <|call|>


def special_tokens() -> list[str]:
    """Every id from 199998 to 201087, named as openai-harmony names it (reserved ones numbered)."""
    return [NAMED_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(FIRST_SPECIAL, VOCAB_SIZE)]


def _ranks() -> dict[bytes, int]:
    path = use_offline_vocab() / "o200k_base.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split(b" ")
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _build(path: Path) -> None:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _ranks()

    class Converter(TikTokenConverter):  # the ranks from our verified file: no tiktoken package needed
        @staticmethod
        def load_tiktoken_bpe(url):
            return ranks

    tok = Converter(vocab_file="o200k", pattern=O200K_PATTERN, extra_special_tokens=special_tokens()).converted()
    fd, tmp = tempfile.mkstemp(prefix=".part-", dir=path.parent)
    os.close(fd)
    tok.save(tmp)
    os.replace(tmp, path)


def tokenizer_json() -> Path:
    """The cached tokenizer.json (built on a miss)."""
    import transformers

    entry = run_cache.root() / "harmony" / f"tokenizer-{run_cache.digest(O200K_SHA256, O200K_PATTERN, transformers.__version__)}.json"
    if not entry.is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        _build(entry)
    return entry


def write_harmony_tokenizer(model_dir: Path) -> Path:
    """tokenizer.json, tokenizer_config.json and generation_config.json (EOS ids) of gpt-oss."""
    model_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_json(), model_dir / "tokenizer.json")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072}))
    gen = model_dir / "generation_config.json"
    existing = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**existing, "bos_token_id": 199998, "eos_token_id": EOS_IDS, "pad_token_id": 199999}))
    return model_dir
