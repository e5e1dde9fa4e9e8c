"""Chat content tokenized as text: control tokens typed into a message cannot open or close
turns (issue 39).

A chat template writes each message between the model's control tokens (`<|start_header_id|>`,
`<|eot_id|>`, `<|im_start|>`, ...). Tokenized as one string, the rendered prompt turns any
control-token *text* inside a message into the control token itself, so a user, or a
document or tool result pasted into a message, can end its turn and open a system turn.
OpenAI's API does not allow that; transformers and vLLM do by default. Here, by default,
what the client wrote is tokenized as plain text (`<|eot_id|>` becomes `<`, `|`, `e`, ...),
and only the template's own control tokens are control tokens.

How: every special token's text in the client's strings (contents, names, reasoning, tool
call arguments: any string of a message) is first replaced by a marker of private-use
characters holding a per-request nonce and the token's index; the template renders as
usual (a template that trims or moves content moves the marker with it); the rendered text
is split at the markers; the pieces between them are tokenized as before, each marker as
its token's text with special tokens off. A prompt whose messages hold no control-token
text (nearly all) is tokenized exactly as before, in one piece; in the others the only
difference besides the neutralised tokens is at the cut points. A template that escapes
non-ASCII text (a marker it printed as `\\ue000`) cannot be split: refused, not served with
the control tokens live.
"""

from __future__ import annotations

import re
import secrets

OPEN, CLOSE = "\ue000", "\ue001"  # Unicode private use: no tokenizer gives them a meaning


class ContentMarkerError(ValueError):
    """The template did not keep the markers as written (it escaped them)."""


def special_pattern(special_texts: list[str]) -> re.Pattern | None:
    """One regex for every special token's text, longest first (`<|im_start|>` before `<|im`)."""
    texts = sorted({t for t in special_texts if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def mark_strings(values: list, pattern: re.Pattern, index: dict[str, int]) -> tuple[list, str | None]:
    """(`values` (messages, tools) with special-token text in their strings replaced by
    markers, the nonce); the nonce is None (and `values` unchanged) when no string holds
    special-token text. A message's role is left alone: the template reads it."""
    nonce = secrets.token_hex(4)
    found = False

    def mark(value):
        nonlocal found
        if isinstance(value, str):
            if pattern.search(value) is None:
                return value
            found = True
            return pattern.sub(lambda m: f"{OPEN}{nonce}:{index[m.group(0)]}{CLOSE}", value)
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    marked = [{k: (v if k == "role" else mark(v)) for k, v in m.items()} if isinstance(m, dict) else mark(m)
              for m in values]
    return (marked, nonce) if found else (values, None)


def split_marked(text: str, nonce: str) -> list[tuple[str, int | None]]:
    """[(text piece, None) | ("", special token index)] in order."""
    if OPEN not in text and "\\ue000" in text.lower():
        raise ContentMarkerError("the chat template escapes non-ASCII text, so control-token text inside a "
                                 "message cannot be kept as text; remove it from the message")
    marker = re.compile(re.escape(OPEN + nonce + ":") + r"(\d+)" + re.escape(CLOSE))
    pieces, at = [], 0
    for m in marker.finditer(text):
        if m.start() > at:
            pieces.append((text[at:m.start()], None))
        pieces.append(("", int(m.group(1))))
        at = m.end()
    if at < len(text):
        pieces.append((text[at:], None))
    return pieces
