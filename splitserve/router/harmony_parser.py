"""Completion token ids of a harmony (gpt-oss) model → OpenAI's `reasoning_content`,
`content` and `tool_calls`, with openai-harmony's StreamableParser (router/harmony.py renders).

The parser is fed token by token, so streamed deltas and the whole message split the same
way; a migrated stream keeps its parser (the router's choice lives across the migration), so
it resumes in the channel it was in. Output that breaks the format (a parse error) is content
from that token on, never dropped.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from openai_harmony import HarmonyError, Role, StreamableParser

from splitserve.router.harmony import END_OF_TEXT, FUNCTIONS, encoding


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


class HarmonyParser:
    """Completion token ids, fed in order (any chunking) → OpenAI delta fields, in order:
    {"reasoning_content": s}, {"content": s}, {"tool_calls": [{"index", "id", "type", "function"}]}
    (a call's first delta names it; later ones add arguments). `reasoning`, `content` and
    `calls` hold the whole message so far; `items` the same in output order, one per harmony
    message ({"type": "reasoning" | "message", "text"} or {"type": "function_call", "call"}),
    as /v1/responses lists its output items."""

    def __init__(self):
        self._parser = StreamableParser(encoding(), role=Role.ASSISTANT)
        self.reasoning = ""
        self.content = ""
        self.calls: list[ParsedCall] = []
        self.items: list[dict] = []
        self._item_message = -1  # the harmony message index of the last item
        self._call_message = -1  # the harmony message index of the last call announced
        self._broken: list[int] | None = None  # tokens since the output left the format
        self._broken_sent = 0

    def feed(self, token_ids: list[int]) -> list[dict]:
        deltas: list[dict] = []
        for token in token_ids:
            if token == END_OF_TEXT:  # an EOS that is no harmony action: the end, nothing to parse
                continue
            if self._broken is not None:
                self._broken.append(token)
                continue
            try:
                self._parser.process(token)
            except HarmonyError:
                self._broken = [token]
                continue
            self._route(self._parser.last_content_delta or "", deltas)
        if self._broken is not None:
            self._broken_text(deltas)
        return _merged(deltas)

    def _route(self, text: str, deltas: list[dict]) -> None:
        p = self._parser
        channel, recipient = p.current_channel, p.current_recipient
        if recipient and recipient.startswith(FUNCTIONS) and p.state.name == "CONTENT":
            index = len(p.messages)
            if index != self._call_message:  # a new call: announced once its header is complete
                self._call_message = index
                self.calls.append(ParsedCall(recipient[len(FUNCTIONS):]))
                call = self.calls[-1]
                self._item("function_call", index).update(call=call)
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            if text:
                self.calls[-1].arguments += text
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})
        elif text and (channel == "analysis" or recipient):  # analysis, or a built-in tool's call: reasoning
            self.reasoning += text
            self._item("reasoning", len(p.messages))["text"] += text
            deltas.append({"reasoning_content": text})
        elif text:  # final, or commentary to the user (a preamble)
            self.content += text
            self._item("message", len(p.messages))["text"] += text
            deltas.append({"content": text})

    def _item(self, kind: str, message_index: int) -> dict:
        if message_index != self._item_message or self.items[-1]["type"] != kind:
            self._item_message = message_index
            self.items.append({"type": kind} if kind == "function_call" else {"type": kind, "text": ""})
        return self.items[-1]

    def _broken_text(self, deltas: list[dict]) -> None:
        text = encoding().decode(self._broken)
        if text.endswith("\ufffd"):  # a character still incomplete: wait for its next bytes
            text = text[:-1]
        new, self._broken_sent = text[self._broken_sent:], max(self._broken_sent, len(text))
        if new:
            self.content += new
            self._item("message", -2)["text"] += new
            deltas.append({"content": new})


def _merged(deltas: list[dict]) -> list[dict]:
    """Adjacent text deltas of one kind joined (a chunk of many tokens is one delta per kind)."""
    out: list[dict] = []
    for d in deltas:
        key = next(iter(d))
        if out and key in ("content", "reasoning_content") and key in out[-1]:
            out[-1] = {key: out[-1][key] + d[key]}
        elif (out and key == "tool_calls" and "tool_calls" in out[-1] and "id" not in d[key][0]
              and out[-1][key][0]["index"] == d[key][0]["index"]):
            prev = out[-1][key][0]
            joined = {**prev, "function": {**prev["function"],
                                           "arguments": prev["function"]["arguments"] + d[key][0]["function"]["arguments"]}}
            out[-1] = {key: [joined]}
        else:
            out.append(d)
    return out
