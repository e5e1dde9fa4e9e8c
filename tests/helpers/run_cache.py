"""Between-run caches for what tests build but never change: random checkpoints and
transformers' reference outputs, each keyed by a hash of everything it is made from, so a
stale entry is never read (a changed builder, config, prompt or library version is a new
key). Under $SPLITSERVE_TEST_CACHE, default ~/.cache/splitserve/tests; delete it at will.

Entries are written to a temporary name and renamed into place (checkpoints with
splitserve.engine.demo.build_checkpoint_once, as the demo is built), so concurrent pytest
processes (xdist workers, two runs) never see half an entry.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from splitserve.core.model_dir import cache_root


def root() -> Path:
    return Path(os.environ.get("SPLITSERVE_TEST_CACHE", cache_root() / "tests"))


@lru_cache(maxsize=1)
def library_versions() -> str:
    import tokenizers
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}"


def digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


@lru_cache(maxsize=1)
def builder_source() -> str:
    """The code that writes a checkpoint (and the tokenizer corpus): part of every key."""
    from splitserve.engine import demo

    corpus = Path(demo.__file__).with_name("demo_corpus.txt").read_bytes()
    return digest(inspect.getsource(demo), hashlib.sha256(corpus).hexdigest())


def cached_checkpoint(out: Path, family: str, fields: dict) -> Path:
    """`out` holds the checkpoint write_checkpoint(out, family, **fields) makes: copied from
    the cache, which is filled on a miss. A copy, not a link: a test that writes into its
    checkpoint directory cannot change the cached one."""
    from splitserve.engine.demo import build_checkpoint_once, write_checkpoint

    entry = root() / "checkpoints" / f"{family}-{digest(family, fields, builder_source(), library_versions())}"
    build_checkpoint_once(entry, lambda tmp: write_checkpoint(tmp, family, **fields))
    shutil.copytree(entry, out, dirs_exist_ok=True)
    return out


def model_digest(model_dir) -> str:
    """A model directory's content: config, tokenizer and weights files."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for f in sorted(d.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors", ".model", ".gguf"):
            h.update(f.name.encode())
            with f.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:24]


def cached_json(kind: str, key_parts: tuple, compute):
    """compute()'s JSON-able result, from the cache when the key was seen before."""
    path = root() / kind / f"{digest(*key_parts, library_versions())}.json"
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".part-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)
    return value
