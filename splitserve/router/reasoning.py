"""Reasoning models: the text of a `<think>...</think>` block is `reasoning_content`, the rest
is `content` (Qwen3 and DeepSeek-R1 style).

Used when the chat template knows the block (it mentions `</think>`). The block is open from
the first token when the model writes `<think>` first, or when the template already opened it
at the end of the prompt (templates that always think); a block never closed (the output
was cut) is all reasoning. With `chat_template_kwargs: {"enable_thinking": false}` Qwen3's
template closes an empty block in the prompt, so everything generated is content.
Streaming holds back only text that could still be the start of a tag.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(template: str | None) -> bool:
    return bool(template) and CLOSE in template


def prompt_opens_block(prompt_tail: str) -> bool:
    """The rendered prompt ends inside an open block (the template wrote `<think>` last)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Feed generated text in order; get (reasoning, content) deltas."""

    def __init__(self, opened: bool):
        self.state = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.pending += text
        reasoning = content = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(OPEN):
                self.state, self.pending = "reasoning", head[len(OPEN):]
            elif OPEN.startswith(head) and not final:
                return "", ""  # could still become "<think>"
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = self.pending.find(CLOSE)
            if end >= 0:
                reasoning, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.state = "content"
            else:
                keep = 0 if final else _partial_suffix(self.pending, CLOSE)
                reasoning, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        if self.state == "content":
            content, self.pending = self.pending, ""
        return reasoning, content
