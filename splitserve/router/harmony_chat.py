"""Chat completions for harmony (gpt-oss) models: the request checks, the prompt and the
choice outputs, in place of the chat template (router/prompts.py) and the text splitters
(router/chat_output.py) other models use.

The prompt is router/harmony.py's rendering; `reasoning_effort` is honoured; harmony's
<|return|> and <|call|> are added to the request's stop tokens. A choice's output is parsed
from its token ids (not its text): analysis → `reasoning_content`, commentary calls to
`functions.X` → `tool_calls`, final → `content`; a turn that ends in a call finishes with
`tool_calls`.

Structured outputs (`response_format`: JSON schema or object; vLLM's choices) and
`tool_choice` `required` or a named function constrain the turn after its analysis
channel: the final channel's text, or one call's arguments (router/harmony_structured.py).
`tool_choice: none` renders no tools; `auto` renders them. A regex or Lark grammar is
refused (400).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from splitserve.router import errors, harmony, harmony_parser, harmony_structured
from splitserve.router.tool_calls import ToolCall


def check_request(req) -> None:
    """Checks, and the request's constraint rewritten for the harmony turn (router/harmony_structured.py)."""
    if req.reasoning_effort is not None and req.reasoning_effort not in harmony.EFFORTS:
        raise errors.invalid_request(f"'reasoning_effort' must be low, medium or high for gpt-oss models, got "
                                     f"{req.reasoning_effort!r}", "reasoning_effort", "invalid_value")
    structured = None if req.tools is not None and req.tools.choice in ("required", "named") else req.params.structured
    req.params = replace(req.params, structured=harmony_structured.constraint(structured, req.tools))


def render_request(req) -> list[int]:
    """The prompt of a chat request (in the tokenizer pool for long ones)."""
    tools = req.tools.tools if req.tools is not None and req.tools.choice != "none" else None
    try:
        return harmony.render(req.messages_for_template(), tools, req.reasoning_effort)
    except ValueError as exc:
        raise errors.invalid_request(str(exc), "messages") from None


def with_stop_tokens(params):
    stops = [t for t in harmony.stop_token_ids() if t not in params.stop_token_ids]
    return replace(params, stop_token_ids=[*params.stop_token_ids, *stops])


@dataclass
class HarmonyMessage:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class HarmonyChatOutput:
    """One choice: fed its token ids as they come (ChoiceRun.take), the same interface as
    router/chat_output.py's ChatOutput."""

    def __init__(self, parallel: bool = True):
        self.parser = harmony_parser.HarmonyParser()
        self.parallel = parallel

    def take(self, text: str, token_ids: list[int], final: bool = False) -> list[dict]:
        deltas = self.parser.feed(token_ids)
        if not self.parallel:  # parallel_tool_calls false: the first call only
            deltas = [d for d in deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        return deltas

    @property
    def message(self) -> HarmonyMessage:
        p = self.parser
        calls = [ToolCall(c.name, c.arguments, c.id) for c in p.calls[: None if self.parallel else 1]]
        return HarmonyMessage(p.content or None, p.reasoning or None, calls)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.calls else reason

    def message_dict(self) -> dict:
        m = self.message
        has_more = m.tool_calls or m.reasoning is not None  # content None beside calls or reasoning, as ChatOutput
        out = {"role": "assistant", "content": m.content if m.content is not None or has_more else "",
               "reasoning_content": m.reasoning}
        if m.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in m.tool_calls]
        return out


@dataclass
class HarmonyOutputConfig:
    """ChatOutputConfig's counterpart: a new HarmonyChatOutput per choice."""

    parallel: bool = True
    keep_special_tokens: bool = False

    def new(self) -> HarmonyChatOutput:
        return HarmonyChatOutput(self.parallel)
