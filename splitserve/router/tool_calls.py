"""Tool calls in generated text, per chat-template family, → OpenAI's `tool_calls`.

The family is read from the checkpoint's chat template (what it tells the model to write):

- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, text before the first block is content;
- llama3_json (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`, calls
  separated by `;`;
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (or, in newer
  tokenizers, `name[ARGS]{...}` per call). `[TOOL_CALLS]` is a special token, so the router
  keeps special tokens in the text of such requests (and drops the end-of-turn token).

Output that does not parse as calls stays content: a model that half-writes a call is
answered with what it wrote, never with an invented call. `AutoToolStream` streams the
content before a call as it comes and holds back only text that may begin a call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from splitserve.core import bounded_json
from splitserve.router.reasoning import _partial_suffix

HERMES, LLAMA3, MISTRAL = "hermes", "llama3_json", "mistral"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MISTRAL_MARK = "[TOOL_CALLS]"


def family_of(template: str | None) -> str | None:
    """The tool-call format a chat template asks for; None when it has none we parse."""
    if not template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if MISTRAL_MARK in template:
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return LLAMA3
    return None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def to_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list | None:
    """Every JSON value in `text`, separated by whitespace or `separators`; None if anything else is there."""
    if bounded_json.too_deep(text):  # model output: any depth, and raw_decode recurses as json.loads does
        return None
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def parse(family: str, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output; no calls when it does not parse as calls."""
    if family == HERMES:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [_call(_loads(body), "arguments") for body in HERMES_CALL.findall(text, start)]
        return (text[:start], calls) if calls and None not in calls else (text, [])
    if family == LLAMA3:
        body = text.strip().removeprefix("<|python_tag|>")
        values = _json_values(body, ";") if body.startswith("{") else None
        calls = [_call(v, "parameters") for v in values or []]
        return ("", calls) if calls and None not in calls else (text, [])
    start = text.find(MISTRAL_MARK)
    if start < 0:
        return text, []
    calls = _mistral_calls(text[start + len(MISTRAL_MARK):])
    return (text[:start], calls) if calls and None not in calls else (text, [])


def _mistral_calls(body: str) -> list[ToolCall | None]:
    body = body.strip()
    if body.startswith("["):
        values = _json_values(body, "")
        return [_call(v, "arguments") for v in values[0]] if values and isinstance(values[0], list) else []
    calls = []
    for part in body.split(MISTRAL_MARK):  # newer tokenizers: name[ARGS]{...}, one marker per call
        name, sep, args = part.partition("[ARGS]")
        calls.append(_call({"name": name.strip(), "arguments": _loads(args)}, "arguments") if sep else None)
    return calls


def _loads(text: str):
    try:
        return bounded_json.loads(text)  # model output: any depth
    except json.JSONDecodeError:
        return None


class AutoToolStream:
    """`tool_choice: auto` over a stream: content until a call begins, then the calls at the end."""

    def __init__(self, family: str):
        self.family = family
        self.content_sent = ""  # content streamed so far
        self.rest = ""  # from a possible call on
        self.in_call = False

    def _marker(self, text: str) -> tuple[int, int]:
        """(where a call starts in `text` or -1, how much of its end to hold back)."""
        if self.family == LLAMA3:  # a call is the whole answer: decided by its first character
            head = text.lstrip()
            if not head:
                return -1, len(text)
            return (0, 0) if head[0] == "{" or head.startswith("<|") else (-1, 0)
        mark = "<tool_call>" if self.family == HERMES else MISTRAL_MARK
        i = text.find(mark)
        return (i, 0) if i >= 0 else (-1, _partial_suffix(text, mark))

    def feed(self, text: str) -> str:
        """Content to stream now."""
        if self.in_call:
            self.rest += text
            return ""
        pending = self.rest + text
        if self.family == LLAMA3 and self.content_sent:  # the answer began as text: never a call
            self.content_sent += pending
            self.rest = ""
            return pending
        start, hold = self._marker(pending)
        if start >= 0:
            self.in_call = True
            out, self.rest = pending[:start], pending[start:]
        else:
            out, self.rest = pending[: len(pending) - hold], pending[len(pending) - hold:]
        self.content_sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still to stream, the calls)."""
        if not self.in_call:
            rest, self.rest = self.rest, ""
            return rest, []
        content, calls = parse(self.family, self.content_sent + self.rest)
        if not calls:
            return self.rest, []
        return content[len(self.content_sent):], calls
