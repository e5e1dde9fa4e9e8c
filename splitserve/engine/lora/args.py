"""The LoRA flags, vLLM's names, on `serve` and on both workers: --enable-lora,
--lora-modules name=path ..., --max-loras, --max-lora-rank. `lora_problem` is the one-line
refusal checked before any process starts: the adapter directories, ranks, and shapes against
the model's config.json (from the safetensors header; the engine checks the weights again
when it loads them)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from splitserve.core.lora_names import lora_name_problem
from splitserve.core.model_config import ModelConfig
from splitserve.engine.lora.adapter import (
    MLA_PROJECTIONS,
    WEIGHTS,
    LoRAAdapterError,
    mla_refusal,
    read_config,
)


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
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec[:300]!r}")
        problem = lora_name_problem(name)
        if problem:  # the rule requests and the runtime API follow (core/lora_names.py)
            raise ValueError(f"--lora-modules: {problem}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection name PEFT may target in this model's checkpoints."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.kv_lora_rank:  # multi-head latent attention: its o_proj and the MLPs (MLA_PROJECTIONS are refused)
        return {"o_proj": (cfg.num_heads * cfg.v_head_dim, h), "gate_proj": (h, i), "up_proj": (h, i),
                "down_proj": (i, h), "gate_up_proj": (h, 2 * i)}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "qkv_proj": (h, q + 2 * kv),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "gate_up_proj": (h, 2 * i)}


def shape_problem(name: str, path: Path, model_dir: Path) -> str | None:
    """An adapter whose shapes (read from the file's header, no weights loaded) do not fit the
    model's config, in the words the engine would use; None when they fit."""
    from safetensors import safe_open

    cfg = ModelConfig.from_dir(model_dir)
    shapes = projection_shapes(cfg)
    try:
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            for key in f.keys():
                if ".lora_A." not in key:
                    continue
                module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
                layer = re.search(r"\.layers\.(\d+)\.", module)
                projection = module.rsplit(".", 1)[-1]
                if ".experts." in module:
                    return f"LoRA adapter {name!r}: {module}: MoE experts are not supported"
                if cfg.kv_lora_rank and projection in MLA_PROJECTIONS:
                    return mla_refusal(name, module)
                if layer is None or int(layer.group(1)) >= cfg.num_layers or projection not in shapes:
                    return (f"LoRA adapter {name!r}: {module} is not an attention or MLP projection of this "
                            "model (wrong base model?)")
                fan_in, fan_out = shapes[projection]
                a = f.get_slice(key).get_shape()
                b_key = key.replace(".lora_A.", ".lora_B.")
                b = f.get_slice(b_key).get_shape() if b_key in f.keys() else None
                if b is None or a[1] != fan_in or b[0] != fan_out:
                    return (f"LoRA adapter {name!r} does not fit this model: {module} has lora_A {tuple(a)} and "
                            f"lora_B {tuple(b) if b else None}, this model's {projection} is {fan_in} -> {fan_out} "
                            "(trained on another base model?)")
    except OSError as exc:
        return f"LoRA adapter {name!r}: cannot read {path / WEIGHTS}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a damaged file: safetensors' own error types, any index error
        return f"LoRA adapter {name!r}: cannot read {path / WEIGHTS} ({type(exc).__name__})"
    return None


def lora_problem(args: argparse.Namespace) -> str | None:
    """Why the LoRA flags cannot be served (one line), or None (which features LoRA combines
    with is engine/args.py compatibility_problem's)."""
    if not getattr(args, "enable_lora", False):
        return "--lora-modules needs --enable-lora" if getattr(args, "lora_modules", []) else None
    if args.max_loras < 1 or args.max_lora_rank < 1:
        return "--max-loras and --max-lora-rank must be at least 1"
    try:
        for name, path in parse_lora_modules(args.lora_modules).items():
            if not Path(path).is_dir():
                raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
            cfg, _ = read_config(name, Path(path))
            if cfg["r"] > args.max_lora_rank:
                raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {cfg['r']}, above --max-lora-rank "
                                       f"{args.max_lora_rank}")
            if not (Path(path) / WEIGHTS).is_file():
                raise LoRAAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS} in {path}")
            model = Path(args.model) if getattr(args, "model", None) else None
            if model is not None and (model / "config.json").is_file():  # else the engine checks at load
                problem = shape_problem(name, Path(path), model)
                if problem:
                    return problem
    except (ValueError, LoRAAdapterError) as exc:
        return str(exc)
    return None


def lora_fields(args: argparse.Namespace) -> dict:
    """EngineConfig's LoRA fields from the flags (after lora_problem said None)."""
    if not getattr(args, "enable_lora", False):
        return {}
    return dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                lora_modules=parse_lora_modules(args.lora_modules))
