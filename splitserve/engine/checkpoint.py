"""Read safetensors weights of a Hugging Face checkpoint (single file or sharded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.core.checkpoint_check import weight_files_problem
from splitserve.core.gguf_model import gguf_source
from splitserve.core.model_config import CheckpointError
from splitserve.engine.parallel.sharding import ShardOf, read_shard, sharded


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, checked against the shard index if there is one
    (core/checkpoint_check.py: the same rule `serve` checks before anything starts)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    files, problem = weight_files_problem(root)
    if problem:
        raise CheckpointError(problem)
    return files


def iter_weights(model_dir: str | Path, shard_of: ShardOf | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read lazily one at a time; for the
    derived directory of a GGUF file (core/gguf_model.py), its tensors, block-quantized
    linears as QuantizedWeights (engine/gguf_weights.py). `shard_of` (tensor parallelism):
    only this rank's part of each tensor it names is read (engine/parallel/sharding.py)."""
    gguf = gguf_source(model_dir)
    if gguf is not None:
        from splitserve.engine.gguf_weights import iter_gguf_weights

        weights = iter_gguf_weights(gguf)
        yield from weights if shard_of is None else sharded(weights, shard_of, str(model_dir))
        return
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    shard = shard_of(name) if shard_of is not None else None
                    yield name, (f.get_tensor(name) if shard is None
                                 else read_shard(f.get_slice(name), shard, f"{model_dir}: {name}"))
        except (OSError, RuntimeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc
