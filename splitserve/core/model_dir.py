"""Which checkpoint directory a command serves, and the name clients ask for it by.

Without --model the random-weight demo model is used. Building it needs torch and
transformers (engine/demo.py), so the commands that hold a model (serve, the workers)
build it on first use; a router alone only reads it and says how to build it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEMO_NAME = "splitserve-demo-llama-random-v1"
DEMO_LABEL = "random-weight demo model (meaningless output)"


def cache_root() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def demo_dir() -> Path:
    return cache_root() / DEMO_NAME


def resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(checkpoint dir, served name); SystemExit with what to do when there is none."""
    model = args.model
    if model is None:
        model = str(demo_dir())
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise SystemExit(f"no --model given and the {DEMO_LABEL} is not built yet: run `splitserve "
                             "demo-model` (or `splitserve serve`, which builds it), or pass --model")
    elif model_is_gguf(model):  # served from the .gguf's derived directory (core/gguf_model.py)
        from splitserve.core.gguf_model import find_gguf, prepare_gguf

        problem = checkpoint_problem(model, getattr(args, "quantization", None))
        if problem:
            print(problem, file=sys.stderr)
            raise SystemExit(2)
        gguf = find_gguf(model)
        if getattr(args, "quantization", None) == "gguf":  # checked above; the file says how each tensor is stored
            args.quantization = None  # (the engine's check reads config.json, which has no quantization_config)
        return str(prepare_gguf(gguf)), args.served_model_name or gguf.stem
    elif not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"{model}/config.json not found: --model must be a Hugging Face checkpoint directory "
                         "or a .gguf file")
    else:
        problem = checkpoint_problem(model, getattr(args, "quantization", None))
        if problem:  # an architecture or config this build cannot serve: say so before starting anything
            print(problem, file=sys.stderr)
            raise SystemExit(2)
    return model, args.served_model_name or os.path.basename(os.path.normpath(model))


def checkpoint_problem(model_dir: str, quantization: str | None = None) -> str | None:
    """One line saying why `model_dir` cannot be served (missing or unsupported config or
    quantization, `quantization` (--quantization) not what the checkpoint holds, missing,
    truncated or garbled weights, no tokenizer), or None. No torch, and no tensor is
    loaded: core/checkpoint_check.py reads the safetensors headers only."""
    from splitserve.core.checkpoint_check import checkpoint_files_problem
    from splitserve.core.gguf_model import gguf_checkpoint_problem, gguf_source
    from splitserve.core.model_config import CheckpointError, ModelConfig
    from splitserve.core.quantization import quantization_from_config

    if model_is_gguf(model_dir) or gguf_source(model_dir) is not None:  # a .gguf, or its derived directory
        return gguf_checkpoint_problem(model_dir, quantization)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return f"{model_dir}/config.json not found: --model must be a Hugging Face checkpoint directory"
    try:
        cfg = ModelConfig.from_dir(model_dir)
        spec = quantization_from_config(cfg.raw, f"{model_dir}/config.json", quantization)
    except CheckpointError as exc:
        return str(exc)
    mtp = cfg.raw.get("num_nextn_predict_layers")  # MTP layers past the decoder's (engine/spec/mtp_model.py)
    return checkpoint_files_problem(model_dir, cfg.vocab_size, cfg.hidden_size, spec, cfg.num_layers,
                                    mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0 else 0)


def served_config(model: str | None):
    """The ModelConfig of the checkpoint --model names (None: the demo's; a .gguf: its derived
    directory's), or None where it cannot be read yet (checkpoint_problem says why)."""
    from splitserve.core.gguf_model import derived_dir, find_gguf
    from splitserve.core.model_config import CheckpointError, ModelConfig

    try:
        gguf = find_gguf(model) if model is not None else None
        directory = demo_dir() if model is None else derived_dir(gguf) if gguf is not None else Path(model)
        return ModelConfig.from_dir(directory) if (directory / "config.json").is_file() else None
    except (CheckpointError, OSError):
        return None


def model_is_gguf(model: str) -> bool:
    """--model names a .gguf file, or a directory with .gguf files and no config.json."""
    path = Path(model)
    if path.suffix == ".gguf" and not path.is_dir():
        return True
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))
