"""What kube-apiserver checks when a CustomResourceDefinition is created, for the
parts CRDs like ours use. The fake API server (fake_kube.py) rejects a CRD with
these errors; tests/operator/test_crd_rules.py runs them on the shipped CRD.

Follows k8s.io/apiextensions-apiserver:
- structural schemas (pkg/apiserver/schema/validation.go, ValidateStructural): every
  node has a type (except int-or-string / preserve-unknown-fields), arrays have items,
  value validations (anyOf, allOf, oneOf, not) carry no types, defaults, descriptions,
  nullable or x-kubernetes-* extensions, root metadata restricts only name/generateName;
- x-kubernetes-* placement (pkg/apis/apiextensions/validation): list-type on arrays,
  map-type on objects, preserve-unknown-fields true or absent, embedded resources;
- CEL rules compile, and `self.<field>` names a field of the node (the API server
  type-checks rules against the schema; cel-python does not, so this is checked here);
- every `default:` (schema/defaulting/validation.go, ValidateDefaults): no unknown
  fields, valid against its node's schema, then the node's CEL rules, on the value
  as written (no nested defaulting: `{}` under a rule reading `self.type` fails with
  "no such key").

One check beyond the API server: each default is validated again after nested
defaulting, which is the value an object omitting the field really gets. A default
passing as written but failing then would make every such object invalid.
"""

from __future__ import annotations

import copy
import json
import re

import celpy

from .crd_values import (
    ROOT_FIELDS,
    apply_defaults,
    compile_rule,
    forbidden,
    invalid,
    openapi_errors,
    prune,
    required,
    rule_errors,
    syntax_error,
)

NESTED_FORBIDDEN = {"default": "must be undefined to be structural", "title": "must be empty to be structural",
                    "description": "must be empty to be structural", "nullable": "must be false to be structural",
                    "additionalProperties": "must be undefined to be structural",
                    "x-kubernetes-preserve-unknown-fields": "must be false to be structural",
                    "x-kubernetes-embedded-resource": "must be false to be structural",
                    "x-kubernetes-int-or-string": "must be false to be structural",
                    "x-kubernetes-list-type": "must be undefined to be structural",
                    "x-kubernetes-map-type": "must be undefined to be structural",
                    "x-kubernetes-list-map-keys": "must be empty to be structural",
                    "x-kubernetes-validations": "must be empty to be structural"}
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
SELF_FIELD = re.compile(r"\bself\.([A-Za-z_]\w*)\b(?!\s*\()")  # self.x, not self.size()


def crd_errors(crd: dict) -> list[str]:
    """Every error kube-apiserver would report for this CRD, in its wording."""
    spec, errors = crd.get("spec") or {}, []
    names = spec.get("names") or {}
    expected = f"{names.get('plural')}.{spec.get('group')}"
    if crd.get("metadata", {}).get("name") != expected:
        errors.append(invalid("metadata.name", crd.get("metadata", {}).get("name"),
                              'must be spec.names.plural+"."+spec.group'))
    versions = spec.get("versions") or []
    if sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(invalid("spec.versions", "array", "must have exactly one version marked as storage version"))
    for i, version in enumerate(versions):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        path = f"spec.versions[{i}].schema.openAPIV3Schema"
        if schema is None:
            errors.append(required(path, "schemas are required"))
            continue
        if "status" in (version.get("subresources") or {}):
            extra = set(schema.get("properties") or {}) - {*ROOT_FIELDS, "spec", "status"}
            if extra:
                errors.append(invalid(path, "object", "only [metadata spec status apiVersion kind] fields are "
                                                      "allowed at the root of the schema if the status subresource "
                                                      f"is enabled, found {sorted(extra)}"))
        structural = structural_errors(schema, path, "root")
        # As the API server: defaults are validated only on a structural schema.
        errors += structural or default_errors(schema, path, resource_root=True)
    return errors


def rejection(crd: dict, errors: list[str]) -> str:
    """The API server's message for an invalid CRD (a 422 Invalid Status)."""
    shown = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    return f'CustomResourceDefinition.apiextensions.k8s.io "{crd.get("metadata", {}).get("name")}" is invalid: {shown}'


def structural_errors(node: dict, path: str, level: str) -> list[str]:
    errors = []
    kind = node.get("type")
    int_or_string, preserve = node.get("x-kubernetes-int-or-string"), node.get("x-kubernetes-preserve-unknown-fields")
    if node.get("x-kubernetes-embedded-resource") and kind != "object":
        errors.append(required(f"{path}.type", "must be object if x-kubernetes-embedded-resource is true"))
    elif not kind and not int_or_string and not preserve:
        errors.append(required(f"{path}.type", {"root": "must not be empty at the root",
                                                "item": "must not be empty for specified array items",
                                                "field": "must not be empty for specified object fields"}[level]))
    if level == "root" and kind and kind != "object":
        errors.append(invalid(f"{path}.type", kind, "must be object at the root"))
    if kind == "array" and "items" not in node:
        errors.append(required(f"{path}.items", "must be specified"))
    if "additionalProperties" in node and level == "root":
        errors.append(forbidden(f"{path}.additionalProperties", "must not be used at the root"))
    if "additionalProperties" in node and node.get("properties"):
        errors.append(forbidden(f"{path}.additionalProperties", "additionalProperties and properties are mutual exclusive"))
    if preserve is False:
        errors.append(invalid(f"{path}.x-kubernetes-preserve-unknown-fields", False, "must be true or undefined"))
    if int_or_string and preserve:
        errors.append(invalid(f"{path}.x-kubernetes-preserve-unknown-fields", True,
                              "must be false if x-kubernetes-int-or-string is true"))
    if "x-kubernetes-list-type" in node and kind != "array":
        errors.append(invalid(f"{path}.x-kubernetes-list-type", node["x-kubernetes-list-type"],
                              "must only be used if type is array"))
    if "x-kubernetes-map-type" in node and kind != "object":
        errors.append(invalid(f"{path}.x-kubernetes-map-type", node["x-kubernetes-map-type"],
                              "must only be used if type is object"))
    if node.get("x-kubernetes-list-map-keys") and node.get("x-kubernetes-list-type") != "map":
        errors.append(invalid(f"{path}.x-kubernetes-list-type", node.get("x-kubernetes-list-type"),
                              'must be "map" if x-kubernetes-list-map-keys is non-empty'))
    if node.get("x-kubernetes-embedded-resource") and not preserve and not node.get("properties"):
        errors.append(required(f"{path}.properties", "must not be empty if x-kubernetes-embedded-resource is true "
                                                     "without x-kubernetes-preserve-unknown-fields"))
    for junctor in ("anyOf", "allOf", "oneOf"):
        for j, nested in enumerate(node.get(junctor) or []):
            if not (int_or_string and junctor == "anyOf" and node[junctor] == INT_OR_STRING):
                errors += _nested_errors(nested, f"{path}.{junctor}[{j}]")
    if "not" in node:
        errors += _nested_errors(node["not"], f"{path}.not")
    errors += _rule_errors(node, path, level)
    props = node.get("properties") or {}
    if level == "root" or node.get("x-kubernetes-embedded-resource"):  # a resource's TypeMeta and ObjectMeta
        for name, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
            if name in props and props[name].get("type") != kind:
                errors.append(invalid(f"{path}.properties[{name}].type", props[name].get("type"), f"must be {kind}"))
    if level == "root" and "metadata" in props:
        meta = props["metadata"]
        if set(meta) - {"type", "properties"} or set(meta.get("properties") or {}) - {"name", "generateName"}:
            errors.append(forbidden(f"{path}.properties[metadata]", "must not specify anything other than name and "
                                                                    "generateName, but metadata is implicitly specified"))
    for name, sub in props.items():
        errors += structural_errors(sub, f"{path}.properties[{name}]", "field")
    if isinstance(node.get("items"), dict):
        errors += structural_errors(node["items"], f"{path}.items", "item")
    if isinstance(node.get("additionalProperties"), dict):
        errors += structural_errors(node["additionalProperties"], f"{path}.additionalProperties", "field")
    return errors


def _nested_errors(nested: dict, path: str) -> list[str]:
    """Inside anyOf/allOf/oneOf/not only value validations may appear."""
    errors = [forbidden(f"{path}.type", "must be empty to be structural")] if "type" in nested else []
    errors += [forbidden(f"{path}.{k}", why) for k, why in NESTED_FORBIDDEN.items() if k in nested]
    if "metadata" in (nested.get("properties") or {}):
        errors.append(forbidden(f"{path}.properties[metadata]", "must not be specified in a nested context"))
    for name, sub in (nested.get("properties") or {}).items():
        errors += _nested_errors(sub, f"{path}.properties[{name}]")
    if isinstance(nested.get("items"), dict):
        errors += _nested_errors(nested["items"], f"{path}.items")
    return errors


def _rule_errors(node: dict, path: str, level: str) -> list[str]:
    """Rules must compile, and a plain `self.x` must name a field of this node."""
    errors = []
    known = set(node.get("properties") or {}) | (set(ROOT_FIELDS) if level == "root" else set())
    open_ended = node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node
    for k, r in enumerate(node.get("x-kubernetes-validations") or []):
        where = f"{path}.x-kubernetes-validations[{k}].rule"
        try:
            compile_rule(r["rule"].strip())
        except celpy.CELParseError as exc:
            errors.append(invalid(where, r["rule"], f"compilation failed: {syntax_error(exc)}"))
            continue
        if node.get("type") == "object" and not open_ended:
            for name in SELF_FIELD.findall(r["rule"]):
                if name not in known:
                    errors.append(invalid(where, r["rule"], f"compilation failed: ERROR: undefined field '{name}'"))
    return errors


def default_errors(node: dict, path: str, resource_root: bool = False, in_metadata: bool = False) -> list[str]:
    errors = []
    if "default" in node:
        where, value = f"{path}.default", node["default"]
        if in_metadata:
            errors.append(forbidden(where, "must not be set in top-level metadata"))
        elif prune(node, copy.deepcopy(value)) != value:
            errors.append(invalid(where, "object", "must not have unknown fields"))
        else:
            found = openapi_errors(node, value, where) or rule_errors(node, value, where)
            if not found:  # the stricter check: the rules on the default as objects get it
                defaulted = apply_defaults(node, copy.deepcopy(value))
                found = [f"{e} (after nested defaulting: {json.dumps(defaulted, sort_keys=True)})"
                         for e in rule_errors(node, defaulted, where)]
            errors += found
    for name, sub in (node.get("properties") or {}).items():
        errors += default_errors(sub, f"{path}.properties[{name}]",
                                 in_metadata=in_metadata or (resource_root and name == "metadata"))
    if isinstance(node.get("items"), dict):
        errors += default_errors(node["items"], f"{path}.items", in_metadata=in_metadata)
    return errors
