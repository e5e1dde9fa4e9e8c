"""spec.loras: LoRA adapters every decode and prefill worker loads at start, each `{name,
path}` or `{name, uri}`. A `path` is found the way spec.model.path is (relative to the
model's volume for pvc / hostPath, absolute inside the image for image sources); a `uri`
(hf://ORG/NAME[@REVISION]) is downloaded by an init container of each engine pod into an
emptyDir at /loras/<name> (the model's tokenSecretRef, if any, authenticates it).
spec.engine.maxLoraRank bounds their rank (default 16). Rendered as --enable-lora
--max-loras N (one slot per adapter: none is ever swapped out) --max-lora-rank R
--lora-modules name=path ... on both roles, so disaggregated prefill applies the same
adapter as decode."""

from __future__ import annotations

import re
from dataclasses import dataclass

from splitserve.core.model_uri import parse_model_uri

from .spec_model import ModelSpec

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MODEL_MOUNT = "/models"  # render_common.MODEL_MOUNT (not imported: render_common imports the spec)
LORA_MOUNT = "/loras"  # the emptyDir the fetch-lora init containers fill


@dataclass(frozen=True)
class LoRASpec:
    modules: tuple[tuple[str, str], ...] = ()  # (name, path in the pod)
    max_rank: int = 16
    downloads: tuple[tuple[str, str], ...] = ()  # (name, hf:// uri): fetched into LORA_MOUNT/name

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
        problems.append("spec.loras must be a list of {name, path} or {name, uri}")
        return LoRASpec()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= 512:
        problems.append(f"spec.engine.maxLoraRank must be an integer in [1, 512], got {rank!r}")
        rank = 16
    modules: list[tuple[str, str]] = []
    downloads: list[tuple[str, str]] = []
    for i, item in enumerate(items):
        where = f"spec.loras[{i}]"
        problem = _item_problem(item, where, model, [n for n, _ in modules])
        if problem:
            problems.append(problem)
        elif "uri" in item:
            downloads.append((item["name"], item["uri"]))
            modules.append((item["name"], f"{LORA_MOUNT}/{item['name']}"))
        else:
            path = item["path"].strip()
            modules.append((item["name"], path if model.source_type == "image" else f"{MODEL_MOUNT}/{path.strip('/')}"))
    return LoRASpec(tuple(modules), rank, tuple(downloads))


def _item_problem(item, where: str, model: ModelSpec, taken: list[str]) -> str | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or \
            ("path" in item) == ("uri" in item) or not isinstance(item.get("path", item.get("uri")), str):
        return f"{where} needs a name and one of path or uri (strings)"
    name = item["name"]
    if not NAME.match(name) or name == model.served_name:
        return (f"{where}.name {name!r} must be 1-63 letters, digits, '.', '_' or '-', and not the served "
                "model name")
    if name in taken:
        return f"{where}.name {name!r} is listed twice"
    if "uri" in item:
        try:
            parse_model_uri(item["uri"])
        except ValueError as exc:
            return f"{where}.uri: {exc}"
        return None
    path = item["path"].strip()
    if not path or ".." in path.split("/"):
        return f"{where}.path must be a non-empty path without '..', got {path!r}"
    if model.source_type == "uri":
        return (f"{where}.path: the model is downloaded (source.type uri), so there is no model volume to find "
                "the adapter on; give the adapter a uri too")
    return None
