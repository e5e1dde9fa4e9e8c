"""A role's pod template: the operator's own settings (hardening, scratch and model
volumes, identity env) plus the role's PodSettings, and for `source.type: uri` the
init container that downloads the model into the model volume. Pure.

The role's env, envFrom and volumeMounts go to every container of the pod, the
download included (a proxy or a CA bundle is needed there first). Placement
(nodeSelector, tolerations, affinity, topology spread) is left out of the Ray head,
which holds no GPU; everything else applies to it too.
"""

from __future__ import annotations

import posixpath
from copy import deepcopy

from . import render_common as c
from .render_lora import add_lora_downloads, fetch_lora_containers
from .spec import InferenceSpec
from .spec_pod import PodSettings

# The download is network- and disk-bound; the limit leaves room for hf_xet's buffers.
FETCH_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}


def with_pod_settings(container: dict, pod: PodSettings) -> dict:
    """The container with the role's env, envFrom and volumeMounts after the operator's
    (copies: no two manifests share a mutable part)."""
    out = dict(container)
    out["env"] = list(container.get("env", [])) + deepcopy(pod.env)
    out["volumeMounts"] = list(container.get("volumeMounts", [])) + deepcopy(pod.volume_mounts)
    if pod.env_from:
        out["envFrom"] = deepcopy(pod.env_from)
    return out


def fetch_model_container(spec: InferenceSpec, pod: PodSettings, weights: bool) -> dict:
    """`splitserve fetch-model` into /models/<path> (the model volume, writable only
    here). `weights=False` for pods that only read config and tokenizer. A path ending in
    .gguf names one file of the repository: only it is downloaded, into its directory."""
    m = spec.model
    dest, extra = c.model_dir(spec), ([] if weights else ["--no-weights"])
    if m.path.endswith(".gguf"):  # one file of the repository; it holds the tokenizer too, so every pod needs it
        dest, extra = posixpath.dirname(dest), ["--file", posixpath.basename(m.path)]
    env = [{"name": "HOME", "value": "/tmp"}]
    if m.token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": m.token_secret.name,
                                                                         "key": m.token_secret.key}}})
    container = {
        "name": "fetch-model", "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["splitserve"],
        "args": ["fetch-model", m.uri, dest, *extra],
        "env": env, "resources": FETCH_RESOURCES, "securityContext": c.container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "model", "mountPath": c.MODEL_MOUNT}],
    }
    return with_pod_settings(container, pod)


def _spread(constraints: list, selector: dict) -> list:
    """A constraint without labelSelector spreads this role's pods (Kubernetes would
    otherwise count no pods at all)."""
    return [x if "labelSelector" in x else {**x, "labelSelector": {"matchLabels": dict(selector)}}
            for x in constraints]


def pod_template(spec: InferenceSpec, role: str, pod: PodSettings, containers: list[dict], *, shm: bool,
                 placement: bool = True, weights: bool = True, node_labels: dict | None = None) -> dict:
    """{metadata, spec} of the pod template of `role`; `node_labels` are extra labels
    that tell pods of one role apart (the Ray head and workers)."""
    node_labels = node_labels or {}
    metadata: dict = {"labels": {**pod.labels, **c.labels(spec, role), **node_labels}}
    annotations = {**pod.annotations, **({c.TOKEN_HASH_ANNOTATION: spec.cluster_token_hash}
                                         if spec.cluster_token_hash else {})}
    if annotations:  # a new token changes the template: the pods roll and read it
        metadata["annotations"] = annotations
    podspec: dict = {
        "containers": [with_pod_settings(x, pod) for x in containers],
        "volumes": c.volumes(spec, shm) + deepcopy(pod.volumes), **c.pod_spec_extras(spec),
    }
    if spec.model.source_type == "uri":
        podspec["initContainers"] = [fetch_model_container(spec, pod, weights)]
    add_lora_downloads(podspec, spec, role, [with_pod_settings(x, pod) for x in
                                             fetch_lora_containers(spec, FETCH_RESOURCES)])  # spec.loras uris
    if placement:
        for key, value in (("nodeSelector", pod.node_selector), ("tolerations", pod.tolerations),
                           ("affinity", pod.affinity),
                           ("topologySpreadConstraints", _spread(pod.topology_spread_constraints,
                                                                 {**c.selector_labels(spec, role), **node_labels}))):
            if value:
                podspec[key] = deepcopy(value)
    if pod.priority_class_name:
        podspec["priorityClassName"] = pod.priority_class_name
    pull_secrets = list(dict.fromkeys(spec.image_pull_secrets + pod.image_pull_secrets))
    if pull_secrets:
        podspec["imagePullSecrets"] = [{"name": s} for s in pull_secrets]
    return {"metadata": metadata, "spec": podspec}
