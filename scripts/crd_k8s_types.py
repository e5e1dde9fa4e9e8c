"""Write the Kubernetes types the InferenceDeployment CRD embeds (affinity, tolerations,
topology spread constraints, env, envFrom, volumes, volumeMounts) from the
Kubernetes OpenAPI schema, so the API server validates their content at
`kubectl apply` exactly as it would in a Pod.

The source is the JSON schema of Kubernetes KUBERNETES_VERSION that the
kubernetes-validate package ships (a test dependency). Each embedded type sits in
the CRD between two marker comments, written only by this script:

    # BEGIN generated Affinity (scripts/crd_k8s_types.py)
    ...
    # END generated Affinity

    python scripts/crd_k8s_types.py          rewrite every marked block
    python scripts/crd_k8s_types.py --check  exit 1 if a block is stale (tests do this)

The conversion to a structural CRD schema: $refs inlined, `null` dropped from types,
descriptions dropped (the CRD would grow tenfold), Quantity and IntOrString become
x-kubernetes-int-or-string, an embedded ObjectMeta keeps only labels and
annotations. BOUNDS adds maxLength where the CRD's CEL rules compare a field: the
API server refuses a CRD whose rules could cost too much on unbounded strings.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import kubernetes_validate
import yaml

KUBERNETES_VERSION = "1.33.0"  # the oldest Kubernetes minor still supported upstream (2026)
CRD = Path(__file__).resolve().parents[1] / "charts/splitserve/crds/inferencedeployments.splitserve.io.yaml"
CORE = "io.k8s.api.core.v1."
TYPES = ("Affinity", "Toleration", "TopologySpreadConstraint", "EnvVar", "EnvFromSource", "Volume",
         "VolumeMount")
INT_OR_STRING = ("io.k8s.apimachinery.pkg.api.resource.Quantity", "io.k8s.apimachinery.pkg.util.intstr.IntOrString")
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
BOUNDS = {  # type -> property -> extra schema keys
    "EnvVar": {"name": {"maxLength": 256}},
    "Volume": {"name": {"maxLength": 63}},  # a DNS label, as Kubernetes requires
    "VolumeMount": {"name": {"maxLength": 63}, "mountPath": {"maxLength": 1024}},
}
KEEP = ("format", "enum", "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")
MARKER = re.compile(r"^(?P<indent> *)# BEGIN generated (?P<type>\w+) \(scripts/crd_k8s_types.py\)$")


def definitions(version: str = KUBERNETES_VERSION) -> dict:
    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local-strict"
    return json.loads((root / "_definitions.json").read_text())["$defs"]


def structural(schema: dict, defs: dict) -> dict:
    """One node of Kubernetes' JSON schema -> the CRD's structural OpenAPI form."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        if name in INT_OR_STRING:
            return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
        if name == OBJECT_META:
            strings = {"type": "object", "additionalProperties": {"type": "string"}}
            return {"type": "object", "properties": {"annotations": strings, "labels": strings}}
        return structural(defs[name], defs)
    out: dict = {}
    types = schema.get("type")
    types = [t for t in types if t != "null"] if isinstance(types, list) else [types]
    if types and types[0]:
        out["type"] = types[0]
    out.update({k: schema[k] for k in KEEP if k in schema and (k != "format" or schema[k] in ("int32", "int64"))})
    if schema.get("required"):
        out["required"] = list(schema["required"])
    if "properties" in schema:
        out["properties"] = {k: structural(v, defs) for k, v in schema["properties"].items()}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"], defs)
    if "items" in schema:
        out["items"] = structural(schema["items"], defs)
    return out


def embedded_type(name: str, defs: dict | None = None) -> dict:
    defs = defs or definitions()
    schema = structural(defs[CORE + name], defs)
    for prop, extra in BOUNDS.get(name, {}).items():
        schema["properties"][prop].update(extra)
    return {"description": f"Kubernetes {KUBERNETES_VERSION} core/v1 {name}, as in a Pod", **schema}


def render_block(name: str, indent: str, defs: dict) -> list[str]:
    text = yaml.safe_dump(embedded_type(name, defs), default_flow_style=None, sort_keys=False, width=110)
    return [f"{indent}# BEGIN generated {name} (scripts/crd_k8s_types.py)"] + \
        [indent + line for line in text.splitlines()] + [f"{indent}# END generated {name}"]


def regenerate(text: str) -> str:
    """The CRD text with every marked block rewritten."""
    defs, out, lines, i = definitions(), [], text.splitlines(), 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        end = f"{m['indent']}# END generated {m['type']}"
        j = lines.index(end, i)
        out += render_block(m["type"], m["indent"], defs)
        i = j + 1
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = CRD.read_text()
    new = regenerate(text)
    if "--check" in argv:
        if new != text:
            print(f"{CRD} has stale generated blocks: run python scripts/crd_k8s_types.py", file=sys.stderr)
            return 1
        return 0
    CRD.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
