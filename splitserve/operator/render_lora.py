"""spec.loras with a uri in the engine pods (decode, prefill): an emptyDir at /loras, one
init container per adapter running `splitserve fetch-model <uri> /loras/<name>` (the same
command the model's uri source uses), and the volume mounted read-only in the workers."""

from __future__ import annotations

from . import render_common as c
from .spec import InferenceSpec
from .spec_lora import LORA_MOUNT

VOLUME = "loras"
ENGINE_ROLES = ("decode", "prefill")


def fetch_lora_containers(spec: InferenceSpec, resources: dict) -> list[dict]:
    env = [{"name": "HOME", "value": "/tmp"}]
    token = spec.model.token_secret  # a private adapter authenticates as the model does
    if token:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    return [{"name": f"fetch-lora-{i}", "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
             "command": ["splitserve"], "args": ["fetch-model", uri, f"{LORA_MOUNT}/{name}"],
             "env": env, "resources": resources, "securityContext": c.container_security_context(),
             "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": VOLUME, "mountPath": LORA_MOUNT}]}
            for i, (name, uri) in enumerate(spec.loras.downloads)]


def add_lora_downloads(podspec: dict, spec: InferenceSpec, role: str, init_containers: list[dict]) -> None:
    """Into an engine pod's spec: the volume, the mounts and `init_containers` (fetch_lora_containers
    with the pod's settings applied)."""
    if role not in ENGINE_ROLES or not spec.loras.downloads:
        return
    podspec["volumes"].append({"name": VOLUME, "emptyDir": {}})
    for container in podspec["containers"]:
        container["volumeMounts"] = [*container.get("volumeMounts", []),
                                     {"name": VOLUME, "mountPath": LORA_MOUNT, "readOnly": True}]
    podspec.setdefault("initContainers", []).extend(init_containers)
