"""gpt-oss's harmony format through openai-harmony (the reference implementation; its grammar
is not re-implemented here): OpenAI chat messages → prompt token ids, and completion token
ids → `reasoning_content`, `content` and `tool_calls`.

Rendering (as vLLM's gpt-oss serving builds it):
- a system message: harmony's model identity and knowledge cutoff, the reasoning effort
  (low / medium / high; harmony's default medium), today's date (UTC) as the conversation
  start; without function tools the commentary channel is not offered;
- a developer message with the request's `system` and `developer` texts as instructions and
  its function tools as harmony ToolDescriptions (omitted when there is neither);
- user turns; earlier assistant turns as `reasoning_content` → analysis, tool calls →
  commentary to `functions.NAME` (`<|constrain|>json`), content → final (commentary when it
  precedes tool calls); tool results from `functions.NAME` to the assistant on commentary,
  the name found through `tool_call_id`. Harmony drops analysis before the last final answer.

Parsing is harmony's StreamableParser fed token by token, so streamed deltas and the whole
message split the same way; a migrated stream keeps its parser (the router's choice lives
across the migration), so it resumes in the channel it was in. Output that breaks the format
(a parse error) is content from that token on, never dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache

from openai_harmony import (
    Author,
    ChannelConfig,
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

EFFORTS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}
CHANNEL_TOKEN, CHANNEL_ID = "<|channel|>", 200005
END_OF_TEXT = 199999  # <|endoftext|>: one of gpt-oss's EOS ids, beside <|return|> and <|call|>
FUNCTIONS = "functions."


class HarmonyUnavailable(RuntimeError):
    """openai-harmony could not load its o200k vocabulary."""


@lru_cache(maxsize=1)
def encoding():
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as exc:
        raise HarmonyUnavailable(f"openai-harmony cannot load o200k_base.tiktoken ({exc}); without network, set "
                                 "TIKTOKEN_ENCODINGS_BASE to a directory holding it (splitserve.core.harmony_vocab "
                                 "builds it from quicktok-v1)") from None


def is_harmony(channel_token_id: int | None) -> bool:
    """Chat in harmony: the tokenizer has harmony's `<|channel|>` at id 200005 (o200k plus the
    harmony specials), as every gpt-oss checkpoint's does. Harmony's rendering is in those ids,
    so the tokenizer decides, not the architecture: a gpt-oss-architecture checkpoint with
    another tokenizer (the engine tests' tiny ones) chats through its own template."""
    return channel_token_id == CHANNEL_ID


def stop_token_ids() -> list[int]:
    """<|return|> and <|call|>: the tokens that end an assistant's turn."""
    return list(encoding().stop_tokens_for_assistant_actions())


# ---- rendering ---------------------------------------------------------------------------------
def today() -> str:
    """The conversation start date harmony's system message states (UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%d")


def system_message(reasoning_effort: str | None, with_tools: bool, start_date: str | None = None) -> Message:
    content = SystemContent.new().with_conversation_start_date(start_date or today())
    if reasoning_effort is not None:
        content = content.with_reasoning_effort(EFFORTS[reasoning_effort])
    if not with_tools:  # nothing to call: the model is not offered the commentary channel (vLLM's choice)
        content = content.with_channel_config(ChannelConfig.require_channels(["analysis", "final"]))
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(instructions: str | None, tools: list[dict] | None) -> Message | None:
    if not instructions and not tools:
        return None
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools([ToolDescription.new(
            t["function"]["name"], t["function"].get("description") or "", t["function"].get("parameters"))
            for t in tools])
    return Message.from_role_and_content(Role.DEVELOPER, content)


def _arguments(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def conversation_messages(messages: list[dict]) -> tuple[str | None, list[Message]]:
    """(developer instructions: the system and developer texts, the other turns as harmony messages).
    Raises ValueError naming the message when a tool result cannot be tied to a function."""
    instructions, out, names = [], [], {}
    for i, m in enumerate(messages):
        role, text = m["role"], m.get("content")
        if role in ("system", "developer"):
            instructions.append(text or "")
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, text or ""))
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if m.get("reasoning_content"):
                out.append(Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis"))
            if text:
                out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(
                    "commentary" if calls else "final"))
            for call in calls:
                name = call["function"]["name"]
                if call.get("id"):
                    names[call["id"]] = name
                out.append(Message.from_role_and_content(Role.ASSISTANT, _arguments(call["function"].get("arguments", "{}")))
                           .with_channel("commentary").with_recipient(FUNCTIONS + name)
                           .with_content_type("<|constrain|>json"))
        else:  # tool
            name = names.get(m.get("tool_call_id")) or m.get("name")
            if not name:
                raise ValueError(f"messages[{i}]: a tool result needs the 'tool_call_id' of an earlier assistant tool "
                                 "call (or a 'name'): harmony addresses results by function name")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, FUNCTIONS + name), text or "")
                       .with_channel("commentary").with_recipient("assistant"))
    return "\n\n".join(instructions) if instructions else None, out


def render(messages: list[dict], tools: list[dict] | None = None, reasoning_effort: str | None = None,
           start_date: str | None = None, instructions: str | None = None,
           add_generation_prompt: bool = True) -> list[int]:
    """Prompt token ids ending in `<|start|>assistant` (without it when not `add_generation_prompt`).
    `messages`: OpenAI chat messages (role, content text, tool_calls, reasoning_content,
    tool_call_id, name); `tools`: OpenAI function tools ({"type": "function", "function":
    {...}}), None when the model may not call any; `instructions`: more developer
    instructions, before the messages' own (the Responses API's)."""
    found, turns = conversation_messages(messages)
    text = "\n\n".join(t for t in (instructions, found) if t) or None
    head = [system_message(reasoning_effort, bool(tools), start_date)]
    dev = developer_message(text, tools)
    conversation = Conversation.from_messages(head + ([dev] if dev else []) + turns)
    if not add_generation_prompt:
        return list(encoding().render_conversation(conversation))
    return list(encoding().render_conversation_for_completion(conversation, Role.ASSISTANT))


# ---- parsing -----------------------------------------------------------------------------------
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
