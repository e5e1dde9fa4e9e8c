"""spec.loras: LoRA adapters every decode and prefill worker loads at start, each
`{name, path}` with `path` found the way spec.model.path is (relative to the model's volume
for pvc / hostPath, absolute inside the image for image sources); spec.engine.maxLoraRank
bounds their rank (default 16). Rendered as --enable-lora --max-loras N (one slot per
adapter: none is ever swapped out) --max-lora-rank R --lora-modules name=path ... on both
roles, so disaggregated prefill applies the same adapter as decode. Adapters fetched from a
URI (hf://) are not built: they would need their own download step."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .spec_model import ModelSpec

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MODEL_MOUNT = "/models"  # render_common.MODEL_MOUNT (not imported: render_common imports the spec)


@dataclass(frozen=True)
class LoRASpec:
    modules: tuple[tuple[str, str], ...] = ()  # (name, path in the pod)
    max_rank: int = 16

    def flags(self) -> list[str]:
        if not self.modules:
            return []
        return ["--enable-lora", "--max-loras", str(len(self.modules)), "--max-lora-rank", str(self.max_rank),
                "--lora-modules", *(f"{name}={path}" for name, path in self.modules)]


def parse_loras(spec: dict, model: ModelSpec, problems: list[str]) -> LoRASpec:
    """spec.loras and spec.engine.maxLoraRank; each bad field adds one problem."""
    items = spec.get("loras") or []
    engine = spec.get("engine") if isinstance(spec.get("engine"), dict) else {}
    rank = engine.get("maxLoraRank", 16)
    if not isinstance(items, list):
        problems.append("spec.loras must be a list of {name, path}")
        return LoRASpec()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 512:
        problems.append(f"spec.engine.maxLoraRank must be an integer in [1, 512], got {rank!r}")
        rank = 16
    if items and model.source_type == "uri":
        problems.append("spec.loras needs spec.model.source.type pvc, hostPath or image (adapters are read from "
                        "the model's volume; a uri source is downloaded, adapters are not)")
        return LoRASpec()
    modules: list[tuple[str, str]] = []
    for i, item in enumerate(items):
        where = f"spec.loras[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            problems.append(f"{where} needs name and path (strings)")
            continue
        name, path = item["name"], item["path"].strip()
        if not NAME.match(name) or name == model.served_name:
            problems.append(f"{where}.name {name!r} must be 1-63 letters, digits, '.', '_' or '-', and not the "
                            "served model name")
        elif any(name == n for n, _ in modules):
            problems.append(f"{where}.name {name!r} is listed twice")
        elif not path or ".." in path.split("/"):
            problems.append(f"{where}.path must be a non-empty path without '..', got {path!r}")
        else:
            modules.append((name, path if model.source_type == "image" else f"{MODEL_MOUNT}/{path.strip('/')}"))
    return LoRASpec(tuple(modules), rank)
