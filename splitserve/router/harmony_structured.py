"""Structured outputs and forced tool calls for harmony (gpt-oss) models: the request's
constraint, wrapped in a Lark grammar of the harmony turn, so the engine's grammar machinery
(core/structured.py, engine/grammar.py) constrains it unchanged.

A harmony answer begins with its analysis channel, so a grammar that constrains from the
first token must let the reasoning through and constrain only what follows (vLLM constrains
after the reasoning ends; here the grammar itself says where that is):

    start: analysis? answer
    analysis: <|channel|> "analysis" <|message|> REASONING <|end|> <|start|> "assistant"
    answer:  <|channel|> "final" <|message|> BODY                         (response_format, choices)
          |  <|channel|> "commentary to=functions.NAME " <|constrain|> "json" <|message|> ARGS
                                                                          (tool_choice required / named)

Special tokens are llguidance's `<|...|>` references (tokens, not text: the reasoning cannot
forge one). JSON bodies are `%json` with the same compact, strict options as elsewhere.
Once the body is complete the grammar takes nothing more, so the engine finishes the turn
(`stop`; a call's turn is reported as `tool_calls`). A regex or Lark grammar of the request
is not nested (its own start rule and terminals would have to be renamed): refused.
"""

from __future__ import annotations

import json

from splitserve.core.structured import StructuredSpec
from splitserve.router import errors

HEAD = ('start: analysis? answer\n'
        'analysis: <|channel|> "analysis" <|message|> REASONING <|end|> <|start|> "assistant"\n'
        'REASONING: /(?s:.*)/\n')
STRICT = {"whitespace_flexible": False, "lenient": False}  # as core/structured.py's JSON


def _json_rule(name: str, schema) -> str:
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise errors.unsupported("response_format", "a JSON schema that is not an object, for gpt-oss models")
    return f"{name}: %json {json.dumps({**schema, 'x-guidance': STRICT}, ensure_ascii=False)}\n"


def _final(body_rules: str) -> str:
    return HEAD + 'answer: <|channel|> "final" <|message|> body\n' + body_rules


def _calls(tools, names: list[str]) -> str:
    alternatives = " | ".join(f"c{i}" for i in range(len(names)))
    out = HEAD + f'answer: <|channel|> "commentary to=functions." ({alternatives})\n'
    for i, name in enumerate(names):
        out += f'c{i}: {json.dumps(name + " ")} <|constrain|> "json" <|message|> a{i}\n'
        out += _json_rule(f"a{i}", tools.parameters(name))
    return out


def constraint(structured: StructuredSpec | None, tools) -> StructuredSpec | None:
    """The grammar the harmony turn is generated under, or None (unconstrained)."""
    if tools is not None and tools.choice in ("required", "named"):
        names = [tools.named] if tools.choice == "named" else [t["function"]["name"] for t in tools.tools]
        return StructuredSpec("grammar", _calls(tools, names), "tool_choice")
    if structured is None:
        return None
    if structured.kind == "json_schema":
        return StructuredSpec("grammar", _final(_json_rule("body", json.loads(structured.spec))), structured.param)
    if structured.kind == "json_object":
        return StructuredSpec("grammar", _final(_json_rule("body", {"type": "object"})), structured.param)
    if structured.kind == "choice":
        options = " | ".join(json.dumps(o, ensure_ascii=False) for o in json.loads(structured.spec))
        return StructuredSpec("grammar", _final(f"body: {options}\n"), structured.param)
    raise errors.unsupported(structured.param, f"a {structured.kind} constraint for gpt-oss (harmony) models (JSON "
                             "schemas, JSON objects and choices are served)")
