"""What is wrong with a checkpoint's files, found before any process starts (issue 39).

`serve` used to find a missing weight file, a truncated or garbled safetensors file or a
missing tokenizer only inside its workers: Ray up, actors spawned, and 18-20 s later a
hundred lines of worker tracebacks and ActorDiedErrors. This reads what can be read
cheaply, without torch and without loading a tensor: the shard index and the files it
names, every safetensors header (8-byte length, JSON, each tensor's byte range within the
file, shape x dtype = its bytes), the embedding's shape against config.json, and that
tokenizer.json is there and is JSON. One line naming the file and the problem, or None.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from splitserve.core import bounded_json

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def safetensors_header(path: Path) -> tuple[dict | None, str | None]:
    """(tensor name -> {dtype, shape, data_offsets}, None) or (None, the problem)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None, f"{path}: {size} bytes, too short for a safetensors file (truncated?)"
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or n > size - 8:
                return None, (f"{path}: its header claims {n} bytes in a file of {size}: not a safetensors "
                              "file, or a truncated or garbled one")
            header = bounded_json.loads(f.read(n))  # a header is 2 levels deep; deeper is garbage
    except OSError as exc:
        return None, f"{path}: cannot be read ({exc.strerror or exc})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None, f"{path}: its safetensors header is not valid JSON (a garbled file)"
    if not isinstance(header, dict):
        return None, f"{path}: its safetensors header is not a JSON object (a garbled file)"
    data_bytes = size - 8 - n
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            expected = math.prod(shape) * DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            return None, f"{path}: tensor {name!r} has a malformed header entry {info!r}"
        if not 0 <= begin <= end <= data_bytes:
            return None, (f"{path}: tensor {name!r} ends at byte {end} of a {data_bytes}-byte data section: "
                          "the file is truncated")
        if end - begin != expected:
            return None, f"{path}: tensor {name!r} ({dtype} {shape}) should be {expected} bytes, has {end - begin}"
        tensors[name] = info
    return tensors, None


def weight_files_problem(root: Path) -> tuple[list[Path], str | None]:
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = bounded_json.load_file(index)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [], f"{index}: expected a JSON object with a 'weight_map' field ({exc})"
        missing = [name for name in files if not (root / name).is_file()]
        if missing:
            return [], f"{index}: names shard(s) that do not exist: {missing}"
        return [root / name for name in files], None
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return [], f"{root}: no *.safetensors weights (and no {INDEX_FILE}; only safetensors checkpoints are served)"
    return files, None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # the decoder layers' tensors, as the engine's loader names them


def layers_problem(headers: dict[str, dict], num_layers: int, source: str, mtp_layers: int = 0) -> str | None:
    """One line when the layers the tensors hold are not those config.json's num_hidden_layers
    names (the engine would build every layer, then fail on the missing or extra tensors); the
    `mtp_layers` after them (num_nextn_predict_layers: DeepSeek-V3's, GLM-4.5's) may be there too."""
    present = {int(m.group(1)) for m in map(_LAYER.match, headers) if m}
    present -= set(range(num_layers, num_layers + mtp_layers))
    if not present or present == set(range(num_layers)):
        return None  # no layer tensors at all: the loader names what is missing
    missing = sorted(set(range(num_layers)) - present)
    extra = sorted(present - set(range(num_layers)))
    said = f"config.json says num_hidden_layers {num_layers}, but the weights hold {len(present)} layer(s)"
    if missing:
        return f"{source}: {said}: none for layer(s) {_some(missing)}"
    return f"{source}: {said}: layer(s) {_some(extra)} are beyond it"


def _some(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:5])) + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


def checkpoint_files_problem(model_dir: str, vocab_size: int, hidden_size: int, quantization=None,
                             num_layers: int | None = None, mtp_layers: int = 0) -> str | None:
    """The first problem with the checkpoint's weight and tokenizer files, or None.
    `quantization` (core/quantization.QuantSpec or None) is checked against the tensors:
    quantized tensors need a quantization_config, and a quantization_config its tensors
    (names, dtypes and group sizes against the weights' shapes). `num_layers`, given, must be
    the layers the tensors hold."""
    from splitserve.core.quantization import tensors_problem

    root = Path(model_dir)
    files, problem = weight_files_problem(root)
    if problem:
        return problem
    headers: dict[str, dict] = {}
    for path in files:
        tensors, problem = safetensors_header(path)
        if problem:
            return problem
        headers.update(tensors)
        for name, info in tensors.items():
            if name.endswith("embed_tokens.weight") and list(info["shape"]) != [vocab_size, hidden_size]:
                return (f"{path}: {name} is {info['shape']}, but config.json says vocab_size {vocab_size} and "
                        f"hidden_size {hidden_size}: the weights and the config are of different models")
    problem = (layers_problem(headers, num_layers, str(root), mtp_layers) if num_layers is not None else None) or \
        tensors_problem(quantization, headers, str(root))
    if problem:
        return problem
    tokenizer = root / "tokenizer.json"
    if not tokenizer.is_file():
        return f"{tokenizer}: not found (only fast tokenizers, tokenizer.json, are supported)"
    try:
        bounded_json.load_file(tokenizer, max_bytes=bounded_json.MAX_TOKENIZER_BYTES)
    except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError (bounds included), UnicodeDecodeError
        return f"{tokenizer}: not a readable JSON tokenizer ({exc})"
    for name in ("tokenizer_config.json", "generation_config.json"):  # read by the router's tokenizer
        path = root / name
        try:
            value = bounded_json.load_file(path, max_bytes=bounded_json.MAX_TOKENIZER_BYTES) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            return f"{path}: not valid JSON ({exc})"
        if not isinstance(value, dict):
            return f"{path}: expected a JSON object"
    return None


def cache_dir_problem(cache: Path) -> str | None:
    """Why the demo model cannot be built under `cache` (not writable), or None."""
    probe = cache
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.is_dir() and os.access(probe, os.W_OK | os.X_OK):
        return None
    why = "is not a writable directory" if probe.is_dir() else "is not a directory"
    return (f"the demo model is built under {cache}, and {probe} {why}: pass --model DIR (a checkpoint "
            "directory) or set SPLITSERVE_CACHE to a writable directory")
