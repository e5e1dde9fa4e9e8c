"""Read safetensors weights of a Hugging Face checkpoint (single file or sharded)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.core.model_config import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked against the shard index if there is one."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map' field ({exc})") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names shard(s) that do not exist: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors weights (and no {INDEX_FILE})")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read lazily one at a time."""
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc
