"""Tool calling, request side: `tools`, `tool_choice`, `parallel_tool_calls` → a `ToolRequest`.

The tool definitions go to the chat template as they came (transformers' templates take
OpenAI's `{"type": "function", "function": {...}}` objects). What the choice asks for:

- `none`: the model answers in text; nothing is parsed as a call.
- `auto`: the model may call tools; its output is parsed per template family
  (router/tool_calls.py).
- a named function: the output is that function's arguments, constrained by the grammar to
  its `parameters` schema, so they always parse and validate.
- `required`: the output is a JSON array of `{"name", "parameters"}` objects, one schema per
  function (at most one item without `parallel_tool_calls`), constrained the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from splitserve.core import bounded_json
from splitserve.core.structured import StructuredSpec
from splitserve.router import errors

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    tools: list[dict]  # as the client sent them, for the template
    choice: str  # none | auto | required | named
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    def parameters(self, name: str) -> dict:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or NO_PARAMETERS

    def constraint(self) -> StructuredSpec | None:
        """The grammar a `required` or named choice is generated under (None otherwise)."""
        if self.choice == "named":
            return StructuredSpec.json_schema(self.parameters(self.named), _param(self, self.named))
        if self.choice != "required":
            return None
        defs: dict = {}
        items = []
        for tool in self.tools:
            name = tool["function"]["name"]
            params = dict(self.parameters(name))
            for key in ("$defs", "definitions"):  # refs point at the root: hoist each function's definitions
                for def_name, schema in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, schema) != schema:
                        raise errors.unsupported("tool_choice", f"'required' with two tools that define a different "
                                                 f"{key}/{def_name}; name one function instead")
            items.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                          "properties": {"name": {"const": name}, "parameters": params}})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, **defs}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredSpec.json_schema(schema, "tools")


def _param(req: ToolRequest, name: str) -> str:
    index = next(i for i, t in enumerate(req.tools) if t["function"]["name"] == name)
    return f"tools[{index}].function.parameters"


def parse_tools(body: dict) -> ToolRequest | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise errors.wrong_type("parallel_tool_calls", "a boolean", parallel)
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise errors.invalid_request("'tool_choice' needs 'tools'", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list):
        raise errors.wrong_type("tools", "an array of tools", tools)
    names = [_tool(t, i) for i, t in enumerate(tools)]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise errors.invalid_request(f"'tools' names the function {dup!r} twice", "tools", "invalid_value")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolRequest(tools, choice or "auto", None, parallel is not False)
    if isinstance(choice, str):
        raise errors.invalid_request(f"'tool_choice' must be none, auto, required or a function, got {choice!r}",
                                     "tool_choice", "invalid_value")
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)):
        raise errors.wrong_type("tool_choice", 'none, auto, required or {"type": "function", "function": '
                                '{"name": ...}}', choice)
    name = function.get("name")
    if name not in names:
        raise errors.invalid_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                                     "tool_choice.function.name", "invalid_value")
    return ToolRequest(tools, "named", name, parallel is not False)


def _tool(tool, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise errors.wrong_type(where, 'a tool {"type": "function", "function": {...}}', tool)
    if tool.get("type") != "function":
        raise errors.unsupported(f"{where}.type", f"tools of type {tool.get('type')!r}; only function tools are served")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise errors.wrong_type(f"{where}.function", "an object with a 'name'", function)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise errors.invalid_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
                                     f"{where}.function.name", "invalid_value")
    params = function.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise errors.wrong_type(f"{where}.function.parameters", "a JSON schema object", params)
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise errors.wrong_type(f"{where}.function.description", "a string", description)
    return name


def arguments_for_template(arguments) -> dict | str:
    """An assistant tool call's `arguments` (a JSON string in OpenAI's API) as templates expect
    them: the object (transformers' convention; Qwen's template writes `arguments | tojson`).
    Text that is not a JSON object stays text."""
    if isinstance(arguments, str):
        try:
            parsed = bounded_json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def message_tool_fields(m: dict, role: str, where: str) -> dict:
    """The tool-calling fields of a history message, as the template sees them: an assistant's
    `tool_calls` (arguments as objects) and `reasoning_content`, a tool result's `tool_call_id`."""
    out: dict = {}
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list):
            raise errors.wrong_type(f"{where}.tool_calls", "an array of tool calls", calls)
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    for key, allowed in (("reasoning_content", role == "assistant"), ("tool_call_id", role == "tool")):
        value = m.get(key)
        if value is not None and allowed:
            if not isinstance(value, str):
                raise errors.wrong_type(f"{where}.{key}", "a string", value)
            out[key] = value
    return out


def _history_call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise errors.wrong_type(where, '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}',
                                call)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str | dict):
        raise errors.wrong_type(f"{where}.function.arguments", "a JSON string", arguments)
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments_for_template(arguments)}}
    if isinstance(call.get("id"), str):
        out = {"id": call["id"], **out}
    return out
