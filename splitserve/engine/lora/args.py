"""The LoRA flags, vLLM's names, on `serve` and on both workers: --enable-lora,
--lora-modules name=path ..., --max-loras, --max-lora-rank. `lora_problem` is the one-line
refusal checked before any process starts (adapters are checked against the model again
when the engine loads them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.engine.lora.adapter import LoRAAdapterError, read_config


def add_lora_args(g) -> None:
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters of the base model: requests name one through `model` "
                        "(docs/architecture.md, Multi-LoRA)")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                   help="PEFT adapter directories loaded at start, each served under its name")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters resident per worker at once (slots; one step mixes at most this many) "
                        "(default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served (default: %(default)s)")


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    modules = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def lora_problem(args: argparse.Namespace) -> str | None:
    """Why the LoRA flags cannot be served (one line), or None."""
    if not getattr(args, "enable_lora", False):
        return "--lora-modules needs --enable-lora" if getattr(args, "lora_modules", []) else None
    if args.max_loras < 1 or args.max_lora_rank < 1:
        return "--max-loras and --max-lora-rank must be at least 1"
    if getattr(args, "tensor_parallel_size", 1) > 1:
        return "--enable-lora is not supported with --tensor-parallel-size > 1 yet"
    try:
        for name, path in parse_lora_modules(args.lora_modules).items():
            if not Path(path).is_dir():
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
            cfg, _ = read_config(name, Path(path))
            if cfg["r"] > args.max_lora_rank:
                raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {cfg['r']}, above --max-lora-rank "
                                       f"{args.max_lora_rank}")
    except (ValueError, LoRAAdapterError) as exc:
        return str(exc)
    return None


def lora_fields(args: argparse.Namespace) -> dict:
    """EngineConfig's LoRA fields from the flags (after lora_problem said None)."""
    if not getattr(args, "enable_lora", False):
        return {}
    return dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                lora_modules=parse_lora_modules(args.lora_modules))
