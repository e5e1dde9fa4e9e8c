"""gpt-oss's harmony format through openai-harmony (the reference implementation; its grammar
is not re-implemented here): the encoding, which models chat in it, and OpenAI chat
messages → prompt token ids.

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

The other direction, completion token ids → OpenAI fields, is router/harmony_parser.py.
"""

from __future__ import annotations

import json
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
