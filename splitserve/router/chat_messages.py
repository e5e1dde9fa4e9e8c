"""Chat `messages` → typed messages for the chat template: roles, text content (strings or
text parts), names, and the tool fields (tool_calls, tool_call_id, reasoning_content) that
router/tools.py reads. Every rejection is a 4xx naming the message and field."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.router import errors
from splitserve.router.tools import message_tool_fields

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatMessage:
    role: str
    content: str | None  # None: an assistant turn that only called tools
    name: str | None = None
    tool_fields: dict = field(default_factory=dict)  # tool_calls, tool_call_id, reasoning_content

    def for_template(self) -> dict:
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out | self.tool_fields


def parse_messages(body: dict) -> list[ChatMessage]:
    messages = body.get("messages")
    if messages is None:
        raise errors.missing_parameter("messages")
    if not isinstance(messages, list):
        raise errors.wrong_type("messages", "an array of messages", messages)
    if not messages:
        raise errors.invalid_request("'messages' must contain at least one message",
                                     "messages", "invalid_value")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: object, i: int) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise errors.wrong_type(where, "an object with 'role' and 'content'", m)
    role = m.get("role")
    if role not in ROLES:
        raise errors.invalid_request(
            f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role",
            "invalid_value")
    content = m.get("content")
    tool_fields = message_tool_fields(m, role, where)
    if content is None and role == "assistant" and not tool_fields.get("tool_calls"):
        content = ""  # transformers' templates get None only beside tool calls
    if isinstance(content, list):
        content = "".join(_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
    if not isinstance(content, str) and not (content is None and tool_fields.get("tool_calls")):
        raise errors.wrong_type(f"{where}.content", "a string or an array of text parts",
                                content)
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise errors.wrong_type(f"{where}.name", "a string", name)
    return ChatMessage(role, content, name, tool_fields)


def _text_part(part: object, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in (None, "text"):
        raise errors.unsupported(where, f"content parts of type {kind!r}; only text is served")
    raise errors.wrong_type(where, 'a text part {"type": "text", "text": "..."}', part)
