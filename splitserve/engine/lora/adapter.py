"""A PEFT LoRA adapter read from its directory, checked against the loaded model.

PEFT writes `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` with, per adapted projection, `...<module>.lora_A.weight`
[r, in] and `...<module>.lora_B.weight` [out, r]; the projection's output gains
scale * B(A(x)), scale = alpha / r (alpha / sqrt(r) with rsLoRA).

Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so a PEFT module
becomes a *part* of one of our modules: its rows of the output and its position among
the module's parts (q=0, k=1, v=2; gate=0, up=1). The model's own `weight_target` (the
checkpoint loader's mapping) says which, so every family that loads names the same way.
What LoRA cannot express here is refused in one line: MoE experts, DoRA, trained biases,
modules_to_save, embeddings / lm_head, per-module ranks, a rank above --max-lora-rank,
shapes of another base model. Under tensor parallelism each rank keeps its part of A or
B, split as the base weight is (sharding.py), after the whole tensors' shapes are checked.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file
from torch import nn

from splitserve.engine.lora.sharding import lora_split, rank_parts, whole_shapes
from splitserve.engine.parallel.state import tp

# our LoRA-capable projections -> how many parts (positions) each has
PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class LoRAAdapterError(ValueError):
    """The adapter cannot be served by this model; the message says why, in one line."""


@dataclass
class LoRAPart:
    position: int  # which part of the fused module (q/k/v, gate/up); 0 for a plain one
    rows: tuple[int, int]  # the output rows of the module this part adds to
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [rows, r], already multiplied by the scale


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    salt: int  # mixed into block hashes: KV computed under this adapter is its own cache entry
    modules: dict[str, list[LoRAPart]] = field(default_factory=dict)  # our module name -> parts

    @property
    def key(self) -> tuple[str, int]:
        """Identity in the slots: a name reloaded with other weights is another adapter."""
        return self.name, self.salt

    def pin(self) -> None:
        """Weights in pinned host memory: a swap into a CUDA slot copies asynchronously."""
        for part in (p for parts in self.modules.values() for p in parts):
            part.a, part.b = part.a.pin_memory(), part.b.pin_memory()


def lora_targets(model: nn.Module) -> dict[str, nn.Module]:
    """The model's projections a LoRA may adapt, by name (e.g. layers.3.self_attn.qkv_proj)."""
    return {name: m for name, m in model.named_modules()
            if name.startswith("layers.") and name.split(".", 2)[-1] in PARTS and hasattr(m, "in_features")}


def adapter_salt(config_bytes: bytes, weight_bytes: bytes) -> int:
    """From the adapter's content (not its name or path): same weights, same KV."""
    digest = hashlib.sha256(config_bytes + b"\0" + weight_bytes).digest()
    return xxhash.xxh3_64_intdigest(b"splitserve-lora-v1\0" + digest) or 1


def read_config(name: str, path: Path) -> tuple[dict, bytes]:
    file = path / CONFIG
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {CONFIG} in {path}")
    raw = file.read_bytes()
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is not JSON ({exc.msg})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG} must be a JSON object, got {_json_type(cfg)}")
    problem = _field_problem(cfg)
    if problem:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG}: {problem}")
    refuse = [
        (cfg.get("peft_type", "LORA") != "LORA", f"peft_type is {cfg.get('peft_type')!r}, only LORA is served"),
        (bool(cfg.get("use_dora")), "DoRA (use_dora) is not supported"),
        (cfg.get("bias", "none") != "none", f"bias={cfg.get('bias')!r} is not supported (only 'none')"),
        (bool(cfg.get("modules_to_save")), "modules_to_save (fully trained modules) is not supported"),
        (bool(cfg.get("rank_pattern") or cfg.get("alpha_pattern")), "per-module ranks (rank_pattern / "
         "alpha_pattern) are not supported"),
        (cfg.get("layers_to_transform") is not None, "layers_to_transform is not supported"),
    ]
    for bad, why in refuse:
        if bad:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {why}")
    return cfg, raw


def _json_type(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# The fields we read, each with its check and what it must be: a config written by hand
# (or by an attacker) is refused naming the field, never a TypeError deep in the load.
_FIELDS = {
    "r": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer"),
    "lora_alpha": (_is_number, "a finite number"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "use_dora": (lambda v: isinstance(v, bool), "true or false"),
    "peft_type": (lambda v: isinstance(v, str), "a string"),
    "bias": (lambda v: isinstance(v, str), "a string"),
    "target_modules": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(m, str) for m in v)),
                       "a string or a list of strings"),
    "modules_to_save": (lambda v: isinstance(v, list), "a list"),
    "rank_pattern": (lambda v: isinstance(v, dict), "an object"),
    "alpha_pattern": (lambda v: isinstance(v, dict), "an object"),
}
_OPTIONAL = set(_FIELDS) - {"r"}  # null or absent is PEFT's default for these


def _field_problem(cfg: dict) -> str | None:
    """The first field of `cfg` that has the wrong type or value, in one line; None if all fit."""
    for key, (ok, what) in _FIELDS.items():
        value = cfg.get(key)
        if value is None and key in _OPTIONAL:
            continue
        if not ok(value):
            shown = repr(value) if isinstance(value, int | float | str) and len(repr(value)) <= 40 else _json_type(value)
            return f"{key} must be {what}, got {shown}"
    return None


def load_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoRAAdapter:
    """Read and check one adapter against `model` (raises LoRAAdapterError, and only that:
    whatever else reading a hostile directory raises is still a bad adapter, said in one line)."""
    try:
        return _read_adapter(name, Path(path), model, max_rank)
    except LoRAAdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - files we do not control: any library error is possible
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot be read from {path} ({type(exc).__name__})") from None


def _read_adapter(name: str, path: Path, model: nn.Module, max_rank: int) -> LoRAAdapter:
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    cfg, config_bytes = read_config(name, path)
    rank = cfg["r"]
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = rank if cfg.get("lora_alpha") is None else cfg["lora_alpha"]
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    weights_file = path / WEIGHTS
    if not weights_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS} in {path}")
    weight_bytes = weights_file.read_bytes()
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {weights_file}: {exc}") from None
    adapter = LoRAAdapter(name, str(path), rank, adapter_salt(config_bytes, weight_bytes))
    targets = lora_targets(model)
    for key in sorted(tensors):
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA A/B weight "
                                       "(embeddings, lm_head and trained biases are not supported)")
            continue
        module = key.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} has no lora_B")
        ours, part = _our_part(name, module, model, targets)
        a = tensors[key]
        # under tensor parallelism: this rank's part of A or B, split as the base weight is (sharding.py)
        split = lora_split(module, model.cfg, tp()) if tp().size > 1 else None
        _check_shapes(name, module, a, b, rank, targets[ours], part, split)
        if split is not None:
            a, b = rank_parts(split, a, b)
        adapter.modules.setdefault(ours, []).append(LoRAPart(part[0], part[1], a.float(), (b.float() * scale)))
    if not adapter.modules:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS} holds no LoRA weights")
    return adapter


# MLA's projections into and out of its latents (engine/models/mla.py): absorbed into other
# matmuls at decode, so a LoRA delta on them would need the absorption redone per adapter
MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def mla_refusal(name: str, module: str) -> str:
    return (f"LoRA adapter {name!r}: {module}: the latent projections of multi-head latent attention are not "
            "supported (o_proj and the MLP projections are)")


def _our_part(name: str, module: str, model: nn.Module, targets: dict) -> tuple[str, tuple[int, tuple[int, int]]]:
    """(our module, (position, rows)) that the PEFT module `module` adapts."""
    if ".experts." in module:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {module}: MoE experts are not supported")
    if model.cfg.kv_lora_rank and module.rpartition(".")[2] in MLA_PROJECTIONS:
        raise LoRAAdapterError(mla_refusal(name, module))
    target = model.weight_target(module + ".weight")
    ours = target[0].removesuffix(".weight") if target else None
    if ours not in targets:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} is not an attention or MLP projection of "
                               "this model (wrong base model?)")
    rows = target[1]
    if rows is None:  # the whole module (a plain projection, or a checkpoint-fused one like Phi-3's)
        return ours, (0, (0, targets[ours].out_features))
    parts = model.part_rows(ours.split(".", 2)[-1])
    return ours, (parts.index((rows.start, rows.stop)), (rows.start, rows.stop))


def _check_shapes(name, module, a, b, rank, linear, part, split) -> None:
    """The file's shapes against the model's (the whole model's under tensor parallelism)."""
    _, (start, stop) = part
    want_a, want_b = (rank, linear.in_features), (stop - start, rank)
    if split is not None:
        want_a, want_b = whole_shapes(split, want_a, want_b)
    if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r} does not fit this model: {module} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, this model needs {want_a} and {want_b} (trained on another base model?)")
