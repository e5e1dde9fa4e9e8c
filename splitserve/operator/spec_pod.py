"""Per-role pod settings of an InferenceDeployment (spec.router/prefill/decode):
placement (nodeSelector, tolerations, affinity, topologySpreadConstraints,
priorityClassName) and pod-template additions (env, envFrom, volumes, volumeMounts,
podAnnotations, podLabels, imagePullSecrets).

The embedded Kubernetes types are validated by the CRD's schema (generated from
Kubernetes' own, scripts/crd_k8s_types.py) and, at the latest, by the API server
when the operator applies the pods' owners. Here, like spec.py, the CRD's CEL rules
are repeated: what the operator itself sets must not be overridden.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# What the renderer (render_common.py, render_pod.py) sets itself; tests check both agree.
OPERATOR_ENV = ("POD_NAME", "POD_NAMESPACE", "POD_IP", "HOME", "HF_HUB_OFFLINE", "HF_TOKEN",
                "SPLITSERVE_REDIS_URL")
OPERATOR_VOLUMES = ("tmp", "dshm", "model", "cluster-token", "cluster-tls")
OPERATOR_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/managed-by",
                   "app.kubernetes.io/instance")
RESERVED_LABEL_PREFIXES = ("splitserve.io/", "ray.io/")  # selectors, and KubeRay's own labels
# /tmp, /dev/shm, /models (or anything below /models: the model volume is read-only), and
# /etc/splitserve/cluster-token and /etc/splitserve/tls and below (token, certificates).
RESERVED_MOUNT = re.compile(r"^/+(tmp|dev/+shm)/*$|^/+models(/.*)?$|^/+etc/+splitserve/+(cluster-token|tls)(/.*)?$")
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class PodSettings:
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    affinity: dict = field(default_factory=dict)
    topology_spread_constraints: list = field(default_factory=list)
    priority_class_name: str = ""
    env: list = field(default_factory=list)
    env_from: list = field(default_factory=list)
    volumes: list = field(default_factory=list)
    volume_mounts: list = field(default_factory=list)
    annotations: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    image_pull_secrets: tuple[str, ...] = ()


def _typed(d: dict, key: str, kind: type, where: str, problems: list[str], items: type = dict):
    """d[key] if it is a `kind` (a list: of `items`), else a problem and an empty one."""
    value = d.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind) or (kind is list and not all(isinstance(x, items) for x in value)):
        what = f"a list of {'strings' if items is str else 'objects'}" if kind is list else "an object"
        problems.append(f"{where}.{key} must be {what}")
        return kind()
    return value


def _names(items: list, key: str) -> list[str]:
    return [str(x.get(key, "")) for x in items if isinstance(x, dict)]


def parse_pod_settings(d: dict, where: str, problems: list[str]) -> PodSettings:
    """spec.<role> -> PodSettings; every problem is appended to `problems`."""
    pod = PodSettings(
        node_selector=_typed(d, "nodeSelector", dict, where, problems),
        tolerations=_typed(d, "tolerations", list, where, problems),
        affinity=_typed(d, "affinity", dict, where, problems),
        topology_spread_constraints=_typed(d, "topologySpreadConstraints", list, where, problems),
        priority_class_name=str(d.get("priorityClassName", "") or ""),
        env=_typed(d, "env", list, where, problems),
        env_from=_typed(d, "envFrom", list, where, problems),
        volumes=_typed(d, "volumes", list, where, problems),
        volume_mounts=_typed(d, "volumeMounts", list, where, problems),
        annotations=_typed(d, "podAnnotations", dict, where, problems),
        labels=_typed(d, "podLabels", dict, where, problems),
        image_pull_secrets=tuple(_typed(d, "imagePullSecrets", list, where, problems, items=str)))
    # The CRD's CEL rules, repeated (see module docstring); same words as their messages.
    if any(n in OPERATOR_ENV for n in _names(pod.env, "name")):
        problems.append(f"{where}.env must not set {', '.join(OPERATOR_ENV)}: the operator sets them "
                        "(the Hugging Face token comes from model.source.tokenSecretRef)")
    if any(n in OPERATOR_VOLUMES for n in _names(pod.volumes, "name")):
        problems.append(f"{where}.volumes[].name must not be tmp, dshm, model, cluster-token or cluster-tls: the operator's own "
                        "volumes have those names")
    if any(RESERVED_MOUNT.match(p) for p in _names(pod.volume_mounts, "mountPath")):
        problems.append(f"{where}.volumeMounts[].mountPath must not be /tmp, /dev/shm, /models, "
                        "/etc/splitserve/cluster-token, /etc/splitserve/tls or below them: the operator mounts its "
                        "own volumes there")
    volumes = set(_names(pod.volumes, "name"))
    if any(n not in volumes for n in _names(pod.volume_mounts, "name")):
        problems.append(f"{where}.volumeMounts[].name must name one of this role's volumes")
    for what, mapping in (("podLabels", pod.labels), ("podAnnotations", pod.annotations)):
        if not all(LABEL_KEY.match(str(k)) for k in mapping):
            problems.append(f"{where}.{what} keys must be [DNS-subdomain prefix/]name, the name at most 63 "
                            "letters, digits, '-', '_' or '.', beginning and ending with a letter or digit")
    if any(k in OPERATOR_LABELS or str(k).startswith(RESERVED_LABEL_PREFIXES) for k in pod.labels):
        problems.append(f"{where}.podLabels must not set app.kubernetes.io/name, component, managed-by or "
                        "instance, nor any splitserve.io/ or ray.io/ label: selectors and KubeRay rely on them")
    if not all(isinstance(v, str) and len(v) <= 63 and LABEL_VALUE.match(v) for v in pod.labels.values()):
        problems.append(f"{where}.podLabels values must be at most 63 letters, digits, '-', '_' or '.', "
                        "beginning and ending with a letter or digit")
    for what, names in (("priorityClassName", [pod.priority_class_name] if pod.priority_class_name else []),
                        ("imagePullSecrets", list(pod.image_pull_secrets))):
        if not all(len(n) <= 253 and DNS_SUBDOMAIN.match(n) for n in names):
            problems.append(f"{where}.{what} must be a DNS subdomain name (lowercase letters, digits, '-' "
                            "and '.', at most 253 characters)")
    return pod
