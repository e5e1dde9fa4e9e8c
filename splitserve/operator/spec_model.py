"""spec.model (where the checkpoint is, and how it gets there) and Secret key
references. As in spec.py, the CRD's CEL rules are repeated with the same words."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.core.model_uri import parse_model_uri

from .spec_fields import int_field


@dataclass(frozen=True)
class SecretRef:
    """One key of a Secret in the InferenceDeployment's namespace."""
    name: str
    key: str


@dataclass(frozen=True)
class ModelSpec:
    served_name: str
    source_type: str  # pvc | hostPath | image | uri
    path: str  # relative to the volume root (pvc, hostPath, uri) or absolute inside the image
    claim_name: str = ""
    host_path: str = ""
    uri: str = ""  # source.type uri: hf://ORG/NAME[@REVISION], downloaded by an init container
    token_secret: SecretRef | None = None  # source.type uri: HF_TOKEN of the download
    tokenizer: str = ""  # same convention as `path`; empty = the model directory
    dtype: str = "bfloat16"
    max_model_len: int | None = None  # None: the checkpoint's own context length


def parse_secret_ref(d: dict, key: str, where: str, problems: list[str]) -> SecretRef | None:
    ref = d.get(key)
    if ref is None:
        return None
    if not isinstance(ref, dict) or not ref.get("name") or not ref.get("key"):
        problems.append(f"{where}.{key} needs name and key (a key of a Secret in this namespace)")
        return None
    return SecretRef(str(ref["name"]), str(ref["key"]))


def parse_model(d: dict, problems: list[str]) -> ModelSpec:
    source = d.get("source", {}) or {}
    model = ModelSpec(
        served_name=str(d.get("servedName", "")), source_type=str(source.get("type", "pvc")),
        path=str(d.get("path", "")), claim_name=str(source.get("claimName", "")),
        host_path=str(source.get("hostPath", "")), uri=str(source.get("uri", "")),
        token_secret=parse_secret_ref(source, "tokenSecretRef", "spec.model.source", problems),
        tokenizer=str(d.get("tokenizer", "")), dtype=str(d.get("dtype", "bfloat16")),
        max_model_len=int_field(d, "maxModelLen", 0, "spec.model", problems) or None)
    if model.dtype not in ("bfloat16", "float16", "float32"):
        problems.append(f"spec.model.dtype must be bfloat16, float16 or float32, got {model.dtype!r}")
    if not model.served_name:
        problems.append("spec.model.servedName is required (the name clients pass as `model`)")
    if model.source_type not in ("pvc", "hostPath", "image", "uri"):
        problems.append(f"spec.model.source.type must be pvc, hostPath, image or uri, got {model.source_type!r}")
    if model.source_type == "uri":
        try:
            parse_model_uri(model.uri)
        except ValueError as exc:
            problems.append(f"spec.model.{exc}")
        if model.tokenizer and model.tokenizer.rstrip("/") != model.path.rstrip("/") \
                and not model.tokenizer.startswith(model.path.rstrip("/") + "/"):
            problems.append("spec.model.tokenizer must lie inside model.path when source.type is uri "
                            "(only that snapshot is downloaded)")
    elif "uri" in source or "tokenSecretRef" in source:
        problems.append("spec.model.source.uri and source.tokenSecretRef are only used by source.type uri")
    if model.source_type == "pvc" and not model.claim_name:
        problems.append("spec.model.source.claimName is required when source.type is pvc")
    if model.source_type == "hostPath" and not model.host_path.startswith("/"):
        problems.append("spec.model.source.hostPath must be an absolute node path when source.type is hostPath")
    for key, value in (("path", model.path), ("tokenizer", model.tokenizer)):
        if key == "path" and not value:
            problems.append("spec.model.path is required (the model directory)")
        elif value and model.source_type == "image" and not value.startswith("/"):
            problems.append(f"spec.model.{key} must be absolute when source.type is image, got {value!r}")
        elif value and model.source_type != "image" and (value.startswith("/") or ".." in value):
            problems.append(f"spec.model.{key} must be relative to the volume root without '..', got {value!r}")
    return model
