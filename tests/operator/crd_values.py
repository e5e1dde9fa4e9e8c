"""What kube-apiserver does to a custom resource's value with a structural schema:
default it, prune unknown fields, validate it (OpenAPI and CEL rules). Used by the
fake API server (fake_kube.py) on every create/update of a custom resource, and by
crd_rules.py to validate a CRD's `default:` values when the CRD is created.

Follows k8s.io/apiextensions-apiserver (schema/defaulting/algorithm.go, pruning,
schema/cel/validation.go). CEL runs on cel-python; values are typed by the schema as
the API server types them (`type: number` is a double even when written as 4).
Errors read like field.Error: "<path>: Invalid value: <value>: <detail>".
"""

from __future__ import annotations

import copy
import json
import re

import celpy
import jsonschema
from celpy import celtypes

ROOT_FIELDS = ("apiVersion", "kind", "metadata")  # kept at a resource root, never pruned


# -- field errors, formatted as k8s.io/apimachinery/pkg/util/validation/field ------
def _shown(value) -> str:
    return json.dumps(value) if isinstance(value, str | int | float | bool) or value is None else f'"{type_name(value)}"'


def type_name(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def invalid(path: str, value, detail: str) -> str:
    return f"{path}: Invalid value: {_shown(value)}: {detail}"


def required(path: str, detail: str = "") -> str:
    return f"{path}: Required value" + (f": {detail}" if detail else "")


def forbidden(path: str, detail: str) -> str:
    return f"{path}: Forbidden: {detail}"


def child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


# -- defaulting and pruning --------------------------------------------------------
def apply_defaults(schema: dict, value):
    """Structural defaulting (algorithm.go): a missing property with a default gets a
    copy of it, and every present value is then defaulted in turn, so a defaulted
    `{}` gets its own children's defaults. Returns the value (dicts changed in place)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if "default" in sub and (name not in value or (value[name] is None and not sub.get("nullable"))):
                value[name] = copy.deepcopy(sub["default"])
        extra = schema.get("additionalProperties")
        for name in list(value):
            if name in props:
                value[name] = apply_defaults(props[name], value[name])
            elif isinstance(extra, dict):
                value[name] = apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], x) for x in value]
    return value


def prune(schema: dict, value, root: bool = False):
    """Drop fields the schema does not specify (pruning/algorithm.go), except under
    x-kubernetes-preserve-unknown-fields and the root's apiVersion/kind/metadata."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        resource_root = root or schema.get("x-kubernetes-embedded-resource")
        for name in list(value):
            if resource_root and name in ROOT_FIELDS:
                continue  # ObjectMeta and TypeMeta have their own rules
            if name in props:
                value[name] = prune(props[name], value[name])
            elif isinstance(extra, dict):
                value[name] = prune(extra, value[name])
            elif extra is not True:
                del value[name]
    elif isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name in value:
                value[name] = prune(sub, value[name])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], x) for x in value]
    return value


# -- OpenAPI validation ------------------------------------------------------------
def json_schema(schema: dict) -> dict:
    """The OpenAPI v3.0 node as JSON Schema draft 4 (which shares its boolean
    exclusiveMinimum): `nullable` becomes a null type, x-kubernetes-* are dropped."""
    out = {}
    for k, v in schema.items():
        if k.startswith("x-kubernetes-") or k in ("nullable", "default", "description"):
            continue
        if k == "properties":
            v = {name: json_schema(sub) for name, sub in v.items()}
        elif k in ("items", "additionalProperties", "not") and isinstance(v, dict):
            v = json_schema(v)
        elif k in ("anyOf", "allOf", "oneOf"):
            v = [json_schema(s) for s in v]
        out[k] = v
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _path(base: str, parts) -> str:
    for p in parts:
        base = child(base, p)
    return base


def openapi_errors(schema: dict, value, path: str) -> list[str]:
    """kube-openapi's messages for the checks CRDs use; others keep jsonschema's."""
    errors = []
    validator = jsonschema.Draft4Validator(json_schema(schema))
    for e in sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path)):
        where = _path(path, e.absolute_path)
        if e.validator == "required":
            name = e.message.split("'")[1]
            errors.append(required(child(where, name)))
        elif e.validator == "enum":
            allowed = ", ".join(json.dumps(x) for x in e.validator_value)
            errors.append(f"{where}: Unsupported value: {json.dumps(e.instance)}: supported values: {allowed}")
        elif e.validator == "type":
            errors.append(invalid(where, e.instance, f"{where} in body must be of type {e.validator_value}: "
                                                     f"{json.dumps(type_name(e.instance))}"))
        elif e.validator in ("minimum", "maximum"):
            word = "greater" if e.validator == "minimum" else "less"
            errors.append(invalid(where, e.instance, f"{where} in body should be {word} than or equal to "
                                                     f"{e.validator_value}"))
        elif e.validator == "pattern":
            errors.append(invalid(where, e.instance, f"{where} in body should match '{e.validator_value}'"))
        elif e.validator in ("minLength", "maxLength", "minItems", "maxItems"):
            errors.append(invalid(where, e.instance, f"{where} in body {e.message}"))
        else:
            errors.append(invalid(where, e.instance, e.message))
    return errors


# -- CEL (x-kubernetes-validations) ------------------------------------------------
def to_cel(schema: dict, value):
    """JSON value -> CEL value, typed by the schema as the API server types it."""
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        return celtypes.MapType({celtypes.StringType(k): to_cel(props.get(k) or (extra if isinstance(extra, dict) else {}), v)
                                 for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([to_cel(schema.get("items") or {}, x) for x in value])
    if isinstance(value, bool) or value is None:
        return celpy.json_to_cel(value)
    if schema.get("type") == "number" and isinstance(value, int | float):
        return celtypes.DoubleType(float(value))
    return celpy.json_to_cel(value)


_ENV = celpy.Environment()
_PROGRAMS: dict[str, celpy.Runner] = {}


def compile_rule(rule: str) -> celpy.Runner:
    """Raises celpy.CELParseError for a rule that does not compile."""
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def _eval_error(exc: celpy.CELEvalError, rule: str, value) -> str:
    """CEL's error text. cel-python reports an error under `||`/`&&` as an overload
    failure; cel-go reports the operand's own error, which for us is a missing field."""
    text = str(exc.args[0])
    if text.startswith("no such member in mapping: "):
        return "no such key: " + text.split(": ", 1)[1].strip("'")
    missing = [f for f in re.findall(r"\bself\.([A-Za-z_]\w*)", rule) if isinstance(value, dict) and f not in value]
    if "CELEvalError" in text and missing:
        return f"no such key: {missing[0]}"
    return text


def syntax_error(exc: celpy.CELParseError) -> str:
    """cel-go's wording for a rule that does not parse."""
    return f"ERROR: <input>:{exc.line}:{exc.column}: Syntax error"


def rule_errors(schema: dict, value, path: str) -> list[str]:
    """Every x-kubernetes-validations rule of the schema and its children on value."""
    if value is None:
        return []
    errors = []
    for r in schema.get("x-kubernetes-validations") or []:
        rule = r["rule"].strip()
        try:
            ok = compile_rule(rule).evaluate({"self": to_cel(schema, value)})
        except celpy.CELParseError as exc:
            errors.append(invalid(path, type_name(value), f"rule compiler initialization error: {syntax_error(exc)}"))
            continue
        except celpy.CELEvalError as exc:
            errors.append(invalid(path, type_name(value), f"{_eval_error(exc, rule, value)} evaluating rule: {rule}"))
            continue
        if not bool(ok):
            where = child(path, r["fieldPath"].lstrip(".")) if r.get("fieldPath") else path
            message = r.get("message") or f"failed rule: {rule}"
            reason = r.get("reason", "FieldValueInvalid")
            errors.append({"FieldValueForbidden": forbidden(where, message),
                           "FieldValueRequired": required(where, message)}.get(
                reason, invalid(where, type_name(value), message)))
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for name, v in value.items():
            sub = props.get(name) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                errors += rule_errors(sub, v, child(path, name))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += rule_errors(schema["items"], v, child(path, i))
    return errors


def value_errors(schema: dict, value, path: str) -> list[str]:
    """OpenAPI first; CEL only on a value of the right shape (as the API server)."""
    return openapi_errors(schema, value, path) or rule_errors(schema, value, path)


def admit(schema: dict, obj: dict) -> tuple[dict, list[str]]:
    """A custom resource as the API server stores it on create/update: pruned,
    defaulted, validated. Returns (object, errors)."""
    obj = apply_defaults(schema, prune(schema, copy.deepcopy(obj), root=True))
    return obj, value_errors(schema, obj, "")
