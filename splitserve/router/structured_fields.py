"""The request fields that ask for structured output → one `StructuredSpec` (core/structured.py).

OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `strict`; chat), and
vLLM's extras (both endpoints): `structured_outputs` ({json | regex | choice | grammar | json_object}) and the
older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one may ask
for a constraint. Only the shape is checked here; whether the schema or grammar compiles is
checked by `core.structured.validate`, which the server runs in its tokenizer pool.
"""

from __future__ import annotations

import json
import re

from splitserve.core import bounded_json
from splitserve.core.structured import InvalidStructuredSpec, StructuredSpec, validate
from splitserve.router import errors

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                           "grammar": "guided_grammar"}
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def parse_structured(body: dict, chat: bool = True) -> StructuredSpec | None:
    """The one constraint the request asks for, or None (`response_format` is chat's only)."""
    found = [spec for spec in (_response_format(body.get("response_format")) if chat else None,
                               _structured_outputs(body.get("structured_outputs")),
                               *(_guided(name, body.get(name)) for name in GUIDED)) if spec is not None]
    if len(found) > 1:
        raise errors.invalid_request(
            f"ask for one structured output at a time, not {' and '.join(s.param for s in found)}",
            found[1].param, "invalid_value")
    for name in ("guided_whitespace_pattern",):
        if body.get(name) is not None:
            raise errors.unsupported(name, "JSON is generated without free whitespace")
    return found[0] if found else None


def _response_format(value) -> StructuredSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise errors.wrong_type("response_format", 'an object such as {"type": "json_object"}', value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object", param="response_format")
    if kind != "json_schema":
        raise errors.invalid_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                                     "response_format.type", "invalid_value")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise errors.wrong_type("response_format.json_schema", "an object with 'name' and 'schema'", js)
    name = js.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise errors.invalid_request("'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-'",
                                     "response_format.json_schema.name", "invalid_value")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise errors.wrong_type("response_format.json_schema.schema", "a JSON schema object", schema)
    strict = js.get("strict")  # the schema is enforced whole either way (core/structured.py)
    if strict is not None and not isinstance(strict, bool):
        raise errors.wrong_type("response_format.json_schema.strict", "a boolean", strict)
    return StructuredSpec.json_schema(schema, "response_format.json_schema.schema")


def _structured_outputs(value) -> StructuredSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise errors.wrong_type("structured_outputs", 'an object such as {"regex": "[0-9]+"}', value)
    for key in sorted(value):
        if key not in (*STRUCTURED_OUTPUTS_KEYS, "json_object") and value[key] not in (None, False):
            raise errors.unsupported(f"structured_outputs.{key}", "use json, regex, choice, grammar or json_object")
    found = [_guided(STRUCTURED_OUTPUTS_KEYS[k], value[k], f"structured_outputs.{k}")
             for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) is not None]
    if value.get("json_object") is True:
        found.append(StructuredSpec("json_object", param="structured_outputs.json_object"))
    if len(found) > 1:
        raise errors.invalid_request("'structured_outputs' must ask for one of json, regex, choice, grammar or "
                                     "json_object", "structured_outputs", "invalid_value")
    return found[0] if found else None


def _guided(name: str, value, param: str | None = None) -> StructuredSpec | None:
    param = param or name
    if value is None:
        return None
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = bounded_json.loads(value)
            except json.JSONDecodeError as exc:
                raise errors.invalid_request(f"'{param}' is not valid JSON: {exc}", param, "invalid_value") from None
        if not isinstance(value, dict | bool):
            raise errors.wrong_type(param, "a JSON schema (an object, or its JSON text)", value)
        return StructuredSpec.json_schema(value, param)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise errors.wrong_type(param, "a non-empty array of non-empty strings", value)
        return StructuredSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise errors.wrong_type(param, "a non-empty string", value)
    return StructuredSpec("regex" if name == "guided_regex" else "grammar", value, param)


def check_structured(spec: StructuredSpec) -> None:
    """400 naming the field when the schema, regex, choice or grammar does not compile (run in
    the tokenizer pool: validation is cached per spec, but a large schema takes milliseconds)."""
    try:
        validate(spec)
    except InvalidStructuredSpec as exc:
        raise errors.invalid_request(str(exc), exc.param, "invalid_value") from None
