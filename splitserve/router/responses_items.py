"""The Responses API's conversation items → the chat messages the chat path renders.

`input` (and a stored conversation, for `previous_response_id`) is a list of items:
messages (user, system, developer, assistant; content a string or text parts), the
assistant's `function_call`s and the client's `function_call_output`s of earlier tool
turns, and `reasoning` items passed back. They map onto chat messages as vLLM's and
OpenAI's own conversion does:

- a message → a chat message with its text (input_text / output_text / refusal parts
  joined); images, files and audio are refused;
- `function_call` → an assistant message's `tool_calls` (consecutive calls, and calls
  right after the assistant's text, share one assistant message: parallel calls);
- `function_call_output` → a `tool` message with its `tool_call_id`;
- `reasoning` → the `reasoning_content` of the assistant turn that follows it.

Every item is checked here, so a mistake is a 400 naming `input[i]`, not a chat message.
"""

from __future__ import annotations

from splitserve.router import errors

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
              "assistant": ("output_text", "refusal", "input_text")}
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def as_items(value, param: str = "input") -> list[dict]:
    """`input` as a list of items: a string is one user message. Each item is checked."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise errors.wrong_type(param, "a string or an array of input items", value)
    for i, item in enumerate(value):
        item_type(item, f"{param}[{i}]")
    return list(value)


def item_type(item, where: str) -> str:
    if not isinstance(item, dict):
        raise errors.wrong_type(where, "an input item (an object with a 'type' or a 'role')", item)
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        why = ("item references need the server-side conversation state of OpenAI's platform; send the item itself"
               if kind == "item_reference" else f"only {', '.join(ITEM_TYPES)} items are served")
        raise errors.unsupported(f"{where}.type", f"input items of type {kind!r}: {why}")
    if kind == "message":
        _message_text(item, where)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            _string(item, key, where)
    elif kind == "function_call_output":
        _string(item, "call_id", where)
        _output_text(item.get("output"), f"{where}.output")
    else:
        _reasoning_text(item, where)
    return kind


def to_messages(items: list[dict], developer_role: str = "system") -> list[dict]:
    """Chat messages for the template. `developer_role`: the role developer messages take
    (templates other than harmony know no developer role: system)."""
    out: list[dict] = []
    reasoning: str | None = None  # a reasoning item's text, waiting for the assistant turn it belongs to
    joinable = False  # the last message is the assistant's, and a function call may join it
    for i, item in enumerate(items):
        kind = item_type(item, f"input[{i}]")
        if kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, f"input[{i}]")
            joinable = False
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if joinable and reasoning is None:
                out[-1].setdefault("tool_calls", []).append(call)
                if out[-1]["content"] == "":
                    out[-1]["content"] = None
            else:
                out.append(_assistant(None, reasoning) | {"tool_calls": [call]})
                reasoning, joinable = None, True
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _output_text(item["output"], f"input[{i}].output")})
            joinable = False
        else:
            role, text = item["role"], _message_text(item, f"input[{i}]")
            if role == "assistant":
                out.append(_assistant(text, reasoning))
                reasoning, joinable = None, True
            else:
                out.append({"role": developer_role if role == "developer" else role, "content": text})
                joinable = False
    if reasoning is not None:  # reasoning with no answer after it: an assistant turn of reasoning only
        out.append(_assistant("", reasoning))
    return out


def _assistant(content: str | None, reasoning: str | None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        raise errors.missing_parameter(f"{where}.{key}")
    if not isinstance(value, str):
        raise errors.wrong_type(f"{where}.{key}", "a string", value)
    return value


def _message_text(item: dict, where: str) -> str:
    role = item.get("role")
    if role not in ROLES:
        raise errors.invalid_request(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}",
                                     f"{where}.role", "invalid_value")
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.wrong_type(f"{where}.content", "a string or an array of content parts", content)
    return "".join(_part(p, TEXT_PARTS[role], f"{where}.content[{j}]") for j, p in enumerate(content))


def _part(part, kinds: tuple[str, ...], where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in kinds:
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise errors.wrong_type(f"{where}.text", "a string", text)
        return text
    if kind in ("input_image", "input_file", "input_audio"):
        raise errors.unsupported(where, f"content parts of type {kind!r}; only text is served")
    raise errors.wrong_type(where, f"a text part of type {' or '.join(kinds)}", part)


def _output_text(output, where: str) -> str:
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise errors.wrong_type(where, "a string or an array of input_text parts", output)
    return "".join(_part(p, ("input_text",), f"{where}[{j}]") for j, p in enumerate(output))


def _reasoning_text(item: dict, where: str) -> str:
    """The reasoning text of a reasoning item: its reasoning_text content, else its summary."""
    if item.get("encrypted_content") is not None:
        raise errors.unsupported(f"{where}.encrypted_content", "this server never encrypts reasoning; pass the "
                                 "reasoning item as it was returned (its reasoning_text content)")
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise errors.wrong_type(f"{where}.{key}", f"an array of {kind} parts", parts)
        texts = [_part(p, (kind,), f"{where}.{key}[{j}]") for j, p in enumerate(parts or [])]
        if texts:
            return "".join(texts)
    return ""
