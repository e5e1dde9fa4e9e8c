"""The request fields that ask for structured output → one StructuredSpec, and the 400s
(naming the field) for bad shapes, conflicts and schemas that do not compile."""

import json

import pytest

from splitserve.core.structured import StructuredSpec
from splitserve.router.errors import APIError
from splitserve.router.protocol import parse_chat_request, parse_completion_request
from splitserve.router.structured_fields import check_structured

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields):
    return parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}, ["m"])


@pytest.mark.parametrize("fields,kind,spec,param", [
    ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     "json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema"),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+", "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]', "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"', "guided_grammar"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+", "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True}}, "json_object", "", "structured_outputs.json_object"),
])
def test_each_field_lands_as_a_spec(fields, kind, spec, param):
    assert chat(**fields).params.structured == StructuredSpec(kind, spec, param)


def test_text_and_absent_ask_for_nothing_and_completions_take_the_vllm_fields():
    assert chat(response_format={"type": "text"}).params.structured is None
    assert chat().params.structured is None
    req = parse_completion_request({"model": "m", "prompt": "x", "guided_choice": ["a"]}, ["m"])
    assert req.params.structured == StructuredSpec("choice", '["a"]', "guided_choice")


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "1 to 64"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}},
     "response_format.json_schema.schema", "a JSON schema object"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty array"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one structured output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of json, regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_whitespace_pattern": " *", "guided_json": SCHEMA}, "guided_whitespace_pattern", "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined with 'response_format'"),
])
def test_bad_requests_are_400_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as err:
        chat(**fields)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


@pytest.mark.parametrize("spec,message", [
    (StructuredSpec.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, "guided_json"),
     "invalid json_schema: Invalid type: strin"),
    (StructuredSpec.json_schema({"type": "string", "format": "no-such-format"}, "response_format.json_schema.schema"),
     "invalid json_schema: Unknown format: no-such-format"),
    (StructuredSpec("regex", "a[b", "guided_regex"), "invalid regex: "),
    (StructuredSpec("grammar", 'start: "yes" | no', "guided_grammar"), 'unknown name: "no"'),
])
def test_a_spec_that_does_not_compile_is_a_400_naming_its_field(spec, message):
    with pytest.raises(APIError) as err:
        check_structured(spec)
    assert err.value.status == 400 and err.value.param == spec.param and message in err.value.message
    assert err.value.code == "invalid_value"
