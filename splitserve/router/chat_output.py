"""One chat choice's generated text → the parts of OpenAI's assistant message, streamed as
deltas: `reasoning_content` (router/reasoning.py), `content`, and `tool_calls`
(router/tools.py says what was asked, router/tool_calls.py parses).

Text flows reasoning splitter → tool handling. What the tool choice does with the content:
none / no tools: it is content; auto: parsed per template family (the first call only
when parallel_tool_calls is false); a named function: the
text *is* the arguments (grammar-constrained), streamed as argument deltas of one call;
required: a JSON array of calls (grammar-constrained), sent when complete. A choice that
called tools finishes with `tool_calls` (unless it was cut at max_tokens: `length`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from splitserve.core import bounded_json
from splitserve.router.reasoning import ReasoningSplitter, prompt_opens_block, template_reasons
from splitserve.router.tool_calls import MISTRAL, AutoToolStream, ToolCall, _call
from splitserve.router.tool_calls import family_of as tool_family_of
from splitserve.router.tools import ToolRequest


@dataclass
class ChatMessageOut:
    """What a non-streaming answer's message holds."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutput:
    def __init__(self, tools: ToolRequest | None = None, tool_family: str | None = None, reasoning: bool = False,
                 reasoning_opened: bool = False, drop_suffix: str | None = None):
        self.tools = tools
        self.drop_suffix = drop_suffix  # text of a special token that ends the output (mistral's EOS)
        self.has_reasoning = reasoning
        self.reasoning = ReasoningSplitter(reasoning_opened) if reasoning else None
        mode = tools.choice if tools is not None else "none"
        self.mode = "none" if mode == "auto" and tool_family is None else mode  # no known format: text only
        self.auto = AutoToolStream(tool_family) if self.mode == "auto" else None
        self.named_call = ToolCall(tools.named, "") if self.mode == "named" else None
        self.buffer = ""  # required: the JSON array so far
        self.message = ChatMessageOut()

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """Delta fields (`{"content": ...}`, `{"reasoning_content": ...}`, `{"tool_calls": [...]}`)
        to send for this much more text; `final` at the end of the choice."""
        deltas: list[dict] = []
        if final and self.drop_suffix:
            text = text.removesuffix(self.drop_suffix)
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text, final)
            if reasoning:
                self.message.reasoning = (self.message.reasoning or "") + reasoning
                deltas.append({"reasoning_content": reasoning})
        if self.mode == "none":
            self._content(text, deltas)
        elif self.mode == "auto":
            self._content(self.auto.feed(text), deltas)
            if final:
                rest, calls = self.auto.finish()
                self._content(rest, deltas)
                self._calls(calls, deltas)
        elif self.mode == "named":
            call = self.named_call
            if not self.message.tool_calls:  # the first delta names the call
                self.message.tool_calls.append(call)
                deltas.append({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                               "function": {"name": call.name, "arguments": text}}]})
            elif text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            call.arguments += text
        else:  # required
            self.buffer += text
            if final:
                calls = self._required_calls()
                if calls:
                    self._calls(calls, deltas)
                else:
                    self._content(self.buffer, deltas)
        return deltas

    def take(self, text: str, token_ids: list[int], final: bool = False) -> list[dict]:
        """ChoiceRun's call: this much more text (and its token ids, which harmony's output,
        router/harmony_chat.py, reads instead)."""
        return self.feed(text, final)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.message.tool_calls else reason

    def message_dict(self) -> dict:
        """The non-streaming answer's message (content None beside tool calls or reasoning)."""
        m = self.message
        content = m.content if m.content is not None or m.tool_calls or m.reasoning is not None else ""
        out = {"role": "assistant", "content": content}
        if self.has_reasoning:
            out["reasoning_content"] = m.reasoning
        if m.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in m.tool_calls]
        return out

    def _content(self, text: str, deltas: list[dict]) -> None:
        if text:
            self.message.content = (self.message.content or "") + text
            deltas.append({"content": text})

    def _calls(self, calls: list[ToolCall], deltas: list[dict]) -> None:
        if self.tools is not None and not self.tools.parallel:
            calls = calls[:1]  # parallel_tool_calls false: the first call only
        if calls:
            start = len(self.message.tool_calls)
            self.message.tool_calls.extend(calls)
            deltas.append({"tool_calls": [c.to_dict(start + i) for i, c in enumerate(calls)]})

    def _required_calls(self) -> list[ToolCall]:
        try:
            items = bounded_json.loads(self.buffer)  # model output: any depth
        except json.JSONDecodeError:
            return []  # cut short (max_tokens): the text is sent as it is
        calls = [_call(item, "parameters") for item in items] if isinstance(items, list) else []
        return calls if calls and None not in calls else []


@dataclass
class ChatOutputConfig:
    """How a request's choices turn text into messages, read from the checkpoint's chat
    template: its tool-call family, whether it has reasoning blocks, and whether the prompt
    opened one. `new()` gives each choice its own ChatOutput."""

    tools: ToolRequest | None
    family: str | None
    reasoning: bool
    opened: bool
    eos_text: str | None

    @classmethod
    def of(cls, tools: ToolRequest | None, tokenizer, prompt: list[int]) -> ChatOutputConfig:
        template = tokenizer.chat_template
        family = tool_family_of(template) if tools is not None and tools.choice == "auto" else None
        reasoning = template_reasons(template)
        opened = reasoning and prompt_opens_block(tokenizer.decode(prompt[-8:], skip_special_tokens=False))
        return cls(tools, family, reasoning, opened, tokenizer.eos_token)

    @property
    def keep_special_tokens(self) -> bool:
        """mistral's [TOOL_CALLS] is a special token: its text must stay in (less the end of turn)."""
        return self.family == MISTRAL

    def new(self) -> ChatOutput:
        return ChatOutput(self.tools, self.family, self.reasoning, self.opened,
                          self.eos_text if self.keep_special_tokens else None)
