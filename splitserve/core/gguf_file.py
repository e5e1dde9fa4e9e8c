"""A GGUF file's header: its metadata scalars and its tensor table, read in a fraction of a
second without torch.

Why not gguf.GGUFReader: it builds a numpy view for every element of every metadata
array, and a GGUF carries its whole vocabulary there (Gemma 3: 262,144 tokens, scores and
types), so opening the file takes 7 s (SmolLM2) to 15 s (Gemma 3 270M) on this machine,
paid by the check `serve` runs before it starts and again by every worker loading the
weights. This walks the same layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md),
skipping arrays by their lengths, and checks every tensor's bytes lie inside the file.

Limits, for files from strangers: metadata arrays nest at most MAX_ARRAY_DEPTH (4) deep (no
writer nests them at all, llama.cpp refuses any nesting; 1,500 levels were a RecursionError
here), and `general.alignment` must be a positive power of two, as llama.cpp requires (the spec
asks for a multiple of 8; 0 was a ZeroDivisionError).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from splitserve.core.model_config import CheckpointError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 4  # arrays of arrays of ...: see above


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    type_name: str  # ggml's name: F32, Q4_K, ... (or "type <n>" for one gguf-py does not know)
    shape: tuple[int, ...]  # row-major, as torch has it: (out_features, in_features)
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, object]  # scalars and strings; arrays as their length
    tensors: list[GGUFTensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The header of a GGUF file; CheckpointError (one line) for a file that is not GGUF,
    is cut short, or names tensor bytes past its end."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, GGML_QUANT_SIZES, GGMLQuantizationType)
    except (OSError, ValueError) as exc:  # mmap of an empty file raises ValueError
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from exc


def _parse(path: Path, buf, sizes, qtypes) -> GGUFHeader:
    if buf[:4] != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    pos = 4

    def take(fmt: str):
        nonlocal pos
        try:
            value = struct.unpack_from("<" + fmt, buf, pos)[0]
        except struct.error:
            raise CheckpointError(f"{path}: not a readable GGUF file, truncated or garbled (its header ends "
                                  f"at byte {pos} of {len(buf)})") from None
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        if pos + n > len(buf):
            raise CheckpointError(f"{path}: not a readable GGUF file, truncated or garbled (a {n}-byte string "
                                  f"at byte {pos} of {len(buf)})")
        pos += n
        return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

    def value(kind: int, depth: int = 0):
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == _STRING:
            return string()
        if kind != _ARRAY:
            raise CheckpointError(f"{path}: not a readable GGUF file, truncated or garbled (value type {kind})")
        if depth >= MAX_ARRAY_DEPTH:  # recursion bounded long before Python's own limit
            raise CheckpointError(f"{path}: metadata arrays nested more than {MAX_ARRAY_DEPTH} deep (at byte {pos}): "
                                  "not a GGUF file any writer produces")
        elem, count = take("I"), take("Q")
        if elem in _SCALARS:  # skipped by length: the vocabulary is most of the header
            pos += count * struct.calcsize(_SCALARS[elem])
        else:
            for _ in range(count):
                value(elem, depth + 1)
        return count

    version = take("I")
    if version not in (2, 3):
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (versions 2 and 3 are)")
    n_tensors, n_kv = take("Q"), take("Q")
    metadata = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, tuple(reversed(dims)), take("I"), take("Q")))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{path}: general.alignment is {align!r}; it must be a positive power of two")
    start = -(-pos // align) * align
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            qtype = qtypes(kind)
            block, type_size = sizes[qtype]
            type_name = qtype.name
        except (ValueError, KeyError):
            type_name, block, type_size = f"type {kind}", 1, 0
        nbytes = math.prod(shape) // block * type_size
        if start + offset + nbytes > len(buf):
            raise CheckpointError(f"{path}: tensor {name} ends at byte {start + offset + nbytes} of a "
                                  f"{len(buf)}-byte file: the file is truncated")
        tensors.append(GGUFTensorInfo(name, type_name, shape, start + offset, nbytes))
    return GGUFHeader(path, version, metadata, tensors)
