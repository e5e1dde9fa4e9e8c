"""Structured outputs, request side: what a completion must match, and its grammar.

A `StructuredSpec` says what the output must be: text valid against a JSON schema, any
JSON object, a regex match, one of a list of strings, or a sentence of a grammar (Lark, or
GBNF as llama.cpp and vLLM write it). It travels with the sampling parameters (router →
decode worker → prefill worker) as its source text; each side turns it into the same
llguidance grammar here. The router validates it (in its tokenizer pool, so a bad schema is
a 400 before routing), the engine compiles it into a matcher (engine/grammar.py).

JSON is generated compactly (`{"a":1,"b":[2,3]}`): no free whitespace, which a small model
could otherwise fill forever. A schema keyword the grammar cannot enforce is an error,
never skipped: the output always matches the whole schema, with or without OpenAI's
`strict` (which only promises that much when true).

torch-free: llguidance has no Python dependencies and imports in milliseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import llguidance

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema or grammar longer than 1 MiB is refused before compiling


class InvalidStructuredSpec(ValueError):
    """A schema, regex, choice list or grammar that cannot constrain the output; the message
    says why, `param` names the request field it came from."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredSpec:
    kind: str  # one of KINDS
    spec: str = ""  # json_schema: the schema as JSON; regex: the pattern; choice: a JSON list; grammar: its text
    param: str = "response_format"  # the request field it came from, for error messages

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str = "response_format") -> StructuredSpec:
        # not sorted: properties are generated in the schema's order, as OpenAI does
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def choice(cls, options: list[str], param: str = "guided_choice") -> StructuredSpec:
        return cls("choice", json.dumps(options, ensure_ascii=False), param)


def grammar_text(spec: StructuredSpec) -> str:
    """The llguidance grammar for `spec` (not yet checked: see validate)."""
    if spec.kind not in KINDS:
        raise InvalidStructuredSpec(spec.param, f"unknown structured output kind {spec.kind!r}")
    if len(spec.spec) > MAX_SPEC_CHARS:
        raise InvalidStructuredSpec(spec.param, f"the {spec.kind} is longer than {MAX_SPEC_CHARS} characters")
    return _grammar_text(spec.kind, spec.spec)


@lru_cache(maxsize=256)
def _grammar_text(kind: str, text: str) -> str:
    options = {"whitespace_flexible": False, "lenient": False}
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.grammar_from("choice", text)
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as exc:
        raise InvalidStructuredSpec("", str(exc)) from None


def validate(spec: StructuredSpec) -> None:
    """Raise InvalidStructuredSpec, naming the request field, if `spec` cannot constrain
    an output. Milliseconds for ordinary schemas; the router runs it off its event loop."""
    try:
        grammar = grammar_text(spec)
        error = _check(grammar)
    except InvalidStructuredSpec as exc:
        raise InvalidStructuredSpec(spec.param, f"invalid {spec.kind}: {exc}") from None
    except BaseException as exc:  # a panic in the Rust side is a BaseException: still this spec's fault
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise InvalidStructuredSpec(spec.param, f"invalid {spec.kind}: {type(exc).__name__}: {exc}") from None
    if error:
        raise InvalidStructuredSpec(spec.param, f"invalid {spec.kind}: {_first_line(error)}")


@lru_cache(maxsize=256)
def _check(grammar: str) -> str:
    return llguidance.LLMatcher.validate_grammar(grammar)


def _first_line(error: str) -> str:
    """llguidance's messages end with the grammar around the error; the first lines say it."""
    lines = [line for line in error.splitlines() if line.strip()]
    return " ".join(lines[:2])[:500]
