"""OpenAI response bodies: non-streaming responses, SSE chunks, usage and logprobs.

Pure builders returning plain dicts (the server serializes them); field names and
`object` values follow the OpenAI API, so the official client parses them as its own.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from splitserve.router.errors import APIError

SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class TokenLogprob:
    token: str  # the detokenized token
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)  # best first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None  # "stop" | "length" | "tool_calls" | None while streaming
    logprobs: list[TokenLogprob] | None = None
    message: dict | None = None  # chat: the whole message (reasoning_content, tool_calls); else content=text


def new_request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


# ---- logprobs, in each API's shape ---------------------------------------------------------
def completion_logprobs(tokens: list[TokenLogprob], text_offset: int = 0) -> dict:
    """Legacy completions shape: parallel arrays; `text_offset` is where the first token
    starts in the completion text (non-zero for later stream chunks)."""
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens],
            "text_offset": offsets}


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
                        for t in tokens]}


# ---- non-streaming -----------------------------------------------------------------------
def completion_response(request_id: str, model: str, created: int, choices: list[Choice],
                        usage: Usage) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": completion_logprobs(c.logprobs)
                         if c.logprobs is not None else None}
                        for c in choices],
            "usage": usage.to_dict()}


def chat_completion_response(request_id: str, model: str, created: int,
                             choices: list[Choice], usage: Usage) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": c.index,
                         "message": c.message or {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason,
                         "logprobs": chat_logprobs(c.logprobs)
                         if c.logprobs is not None else None}
                        for c in choices],
            "usage": usage.to_dict()}


# ---- streaming ---------------------------------------------------------------------------
def completion_chunk(request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None,
                     logprobs: list[TokenLogprob] | None = None, text_offset: int = 0) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason,
                         "logprobs": completion_logprobs(logprobs, text_offset)
                         if logprobs is not None else None}]}


def chat_chunk(request_id: str, model: str, created: int, index: int, content: str | None,
               finish_reason: str | None = None, logprobs: list[TokenLogprob] | None = None,
               first: bool = False, fields: dict | None = None) -> dict:
    """One delta. The first chunk of each choice carries the role; the last has
    `finish_reason` (and may have content None). `fields`: more delta members
    (reasoning_content, tool_calls)."""
    delta: dict = {"role": "assistant"} if first else {}
    if content is not None:
        delta["content"] = content
    delta.update(fields or {})
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": chat_logprobs(logprobs) if logprobs is not None else None}]}


def usage_chunk(request_id: str, model: str, created: int, usage: Usage, chat: bool) -> dict:
    """The extra last chunk that `stream_options.include_usage` asks for: no choices."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "system_fingerprint": None, "choices": [],
            "usage": usage.to_dict()}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def sse_error(error: APIError) -> bytes:
    """An error after the stream has started (the status line is already sent)."""
    return sse(error.body())


def models_list(models: list[str], created: int, owned_by: str = "splitserve") -> dict:
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": owned_by}
                     for m in models]}
