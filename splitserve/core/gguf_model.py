"""A GGUF file served as it ships: `--model path/to/model.gguf` (or a directory holding one
.gguf and no config.json).

Everything else in splitserve (router, workers, Ray actors, chat templates, the checks in
core/checkpoint_check.py) reads a Hugging Face checkpoint DIRECTORY: config.json,
tokenizer.json, tokenizer_config.json. So a GGUF is turned, once, into a small derived
directory under cache_root()/gguf/<stem>-<hash of path, size and mtime>/ holding those three
files, derived from the GGUF's metadata by transformers' own GGUF conversion (the same code
`from_pretrained(..., gguf_file=...)` runs, so config and tokenizer agree with it token for
token), and gguf_source.json naming the .gguf: the weights are read from the GGUF itself
(engine/gguf_weights.py), never copied.

The conversion needs transformers, which this torch-free core never imports (the router
and operator stand on it): it runs in a child process (engine/gguf_derive.py) that writes
a temporary directory and renames it into place, so concurrent workers do not race and a
half-written directory is never seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from splitserve.core.model_config import CheckpointError

SOURCE_FILE = "gguf_source.json"  # in a derived directory: {"gguf": absolute path, "size": bytes}
DERIVE_TIMEOUT_S = 300


def find_gguf(model: str | os.PathLike) -> Path | None:
    """The .gguf `--model` names (the file, or the one .gguf of a directory without
    config.json), or None for an ordinary checkpoint directory. CheckpointError when a
    directory holds several."""
    path = Path(model)
    if path.suffix == ".gguf" and not path.is_dir():
        if not path.is_file():
            raise CheckpointError(f"{path}: GGUF file not found")
        return path.resolve()
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(f"{path}: holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                              "pass --model the one to serve")
    return found[0].resolve() if found else None


def derived_dir(gguf: Path) -> Path:
    """Where `gguf`'s derived directory lives: a new file (or the same path rewritten)
    gets a new directory, so a stale derivation is never served."""
    from splitserve.core.model_dir import cache_root

    st = gguf.stat()
    key = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    return cache_root() / "gguf" / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def gguf_source(model_dir: str | os.PathLike) -> Path | None:
    """The .gguf a derived directory reads its weights from, or None for a safetensors
    checkpoint."""
    source = Path(model_dir) / SOURCE_FILE
    if not source.is_file():
        return None
    try:
        return Path(json.loads(source.read_text())["gguf"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{source}: unreadable ({exc}); delete {model_dir} and serve the .gguf again") from exc


def prepare_gguf(gguf: Path) -> Path:
    """The derived checkpoint directory of `gguf`, built now if it is not there yet."""
    target = derived_dir(gguf)
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "splitserve.engine.gguf_derive", str(gguf), str(target)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DERIVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{gguf}: reading its metadata took over {DERIVE_TIMEOUT_S} s") from None
    if done.returncode != 0 or not (target / SOURCE_FILE).is_file():
        lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
        raise CheckpointError(lines[-1] if lines else f"{gguf}: cannot derive a checkpoint directory from it")
    return target


def gguf_header_problem(gguf: Path) -> str | None:
    """Why `gguf` cannot be read (missing, not GGUF, truncated), or None; reads the header
    and the tensor table only (core/gguf_file.py)."""
    from splitserve.core.gguf_file import read_gguf_header

    if not gguf.is_file():
        return f"{gguf}: GGUF file not found"
    try:
        read_gguf_header(gguf)
    except CheckpointError as exc:
        return str(exc)
    return None


# GGUF tensor types engine/gguf_weights.py converts (float, or exactly to a QuantizedWeight)
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def gguf_checkpoint_problem(model: str, quantization: str | None = None) -> str | None:
    """One line saying why the GGUF `model` names cannot be served, or None; derives its
    directory (once) on the way, so that the workers find it ready."""
    from splitserve.core.model_config import ModelConfig

    try:
        gguf = find_gguf(model) or gguf_source(model)
        if quantization not in (None, "gguf"):
            return f"{gguf}: --quantization {quantization} given, but the model is a GGUF file (drop the flag)"
        problem = gguf_header_problem(gguf)
        if problem:
            return problem
        derived = prepare_gguf(gguf)
        cfg = ModelConfig.from_dir(derived)
    except CheckpointError as exc:
        return str(exc)
    return gguf_tensors_problem(gguf, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) or (
        None if (derived / "tokenizer.json").is_file() else f"{derived}/tokenizer.json: not found")


def gguf_tensors_problem(gguf: Path, vocab_size: int, hidden_size: int, num_layers: int | None = None) -> str | None:
    """A tensor type this build cannot convert, an embedding whose shape is not the config's,
    or (with `num_layers`) blocks other than the metadata's block_count, or None."""
    from splitserve.core.gguf_file import read_gguf_header

    tensors = read_gguf_header(gguf).tensors
    blocks = {int(m.group(1)) for m in (re.match(r"blk\.(\d+)\.", t.name) for t in tensors) if m}
    if num_layers is not None and blocks and blocks != set(range(num_layers)):
        return (f"{gguf}: its metadata says {num_layers} block(s) (block_count), but its tensors hold "
                f"{len(blocks)}, numbered {min(blocks)} to {max(blocks)}")
    for t in tensors:
        if t.type_name not in FLOAT_TYPES + QUANT_TYPES:
            return (f"{gguf}: tensor {t.name} is {t.type_name}, which is not supported (supported: "
                    f"{', '.join(FLOAT_TYPES + QUANT_TYPES)})")
        if t.name == "token_embd.weight" and list(t.shape) != [vocab_size, hidden_size]:
            return (f"{gguf}: token_embd.weight is {list(t.shape)}, but its metadata says vocab_size {vocab_size} "
                    f"and hidden_size {hidden_size}")
    return None
