"""Prompts to token ids at the router, without stalling its event loop.

Short texts (most requests) are tokenized inline: a thread hop would cost more than the
work. Long ones go to a small thread pool, where the tokenizer runs without the GIL, so
/health, other streams and heartbeats go on meanwhile; a text longer than the context is
counted, refused, and never turned into a Python list; one far longer than the context is
refused from its start alone. Chat templates with long content render in the pool too. After a large input the C heap is trimmed, so a burst of huge
prompts does not leave the router holding gigabytes.

At most `max_pending` long inputs wait or run at once; more are refused with 429, so a
client sending megabytes cannot queue everyone else's prompts behind its own. Large bodies
are parsed in the same pool (server.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from concurrent.futures import ThreadPoolExecutor

from splitserve.core import tracing
from splitserve.core.chat_content import ContentMarkerError
from splitserve.core.tokenizer import ChatTemplateError, Tokenizer
from splitserve.router import errors
from splitserve.router.errors import APIError

log = logging.getLogger(__name__)

INLINE_CHARS = 8192  # about 8 ms of tokenizing: cheaper inline than a thread hop
TRIM_CHARS = 1 << 20  # after inputs this large, give freed memory back to the OS
PROBE_CHARS_PER_TOKEN = 32  # texts over context x this many characters: tokenize the start first


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # not glibc: nothing to tune


_LIBC = _glibc()
_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION = 1 << 20


def return_large_buffers_at_once() -> None:
    """Bodies, their JSON strings and tokenizer outputs of megabytes get their own mappings,
    unmapped when freed. (glibc's default raises its mmap threshold after the first large
    free, so later megabyte buffers land on the heap and their pages stay with the router.)"""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION)


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, workers: int = 2, max_pending: int = 8,
                 content_as_text: bool = True):
        self.tokenizer = tokenizer
        self.content_as_text = content_as_text  # --parse-control-tokens-in-content turns it off
        self.max_model_len = max_model_len
        self.max_pending = max_pending
        self.pending = 0
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        return_large_buffers_at_once()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        with tracing.span("tokenize", attributes={"splitserve.prompt_chars": len(text)}) as span:
            if len(text) <= INLINE_CHARS:
                ids = self._checked(*self.tokenizer.encode_bounded(text, self.max_model_len, add_special_tokens),
                                    param)
            else:
                ids = await self.offload(self._encode_long, text, add_special_tokens, param)
            span.set_attribute("gen_ai.usage.input_tokens", len(ids))
            return ids

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:
        """`tools` and `template_kwargs` (chat_template_kwargs) go to the template as in transformers."""
        size = sum(len(m.get("content") or "") for m in messages) + sum(len(str(t)) for t in tools or ())
        args = (messages, add_generation_prompt, add_special_tokens, tools, template_kwargs)
        with tracing.span("tokenize", attributes={"splitserve.prompt_chars": size, "splitserve.chat_template": True}
                          ) as span:
            ids = self._render_and_encode(*args) if size <= INLINE_CHARS else await self.offload(
                self._render_and_encode, *args)
            span.set_attribute("gen_ai.usage.input_tokens", len(ids))
            return ids

    # ---- in the pool (or inline for small inputs) -----------------------------------------
    def _render_and_encode(self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                           tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        try:
            text, nonce = self.tokenizer.render_chat(messages, add_generation_prompt, tools, template_kwargs,
                                                     self.content_as_text)
        except ChatTemplateError as exc:
            raise errors.invalid_request(str(exc), "messages") from None
        # The template writes the special tokens itself (as transformers does): no more by default.
        if nonce is None:
            return self._encode_long(text, add_special_tokens, "messages")
        # control-token text in a message: tokenized as text (core/chat_content.py)
        self._refuse_far_too_long(text, add_special_tokens, "messages")
        try:
            ids = self.tokenizer.encode_rendered(text, nonce, add_special_tokens)
        except ContentMarkerError as exc:
            raise errors.invalid_request(str(exc), "messages") from None
        return self._checked(len(ids), ids if len(ids) <= self.max_model_len else None, "messages")

    def _encode_long(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            self._refuse_far_too_long(text, add_special_tokens, param)
            return self._checked(*self.tokenizer.encode_bounded(text, self.max_model_len, add_special_tokens), param)
        finally:
            if len(text) >= TRIM_CHARS and _LIBC is not None:
                _LIBC.malloc_trim(0)  # the tokenizer's many small allocations

    def _refuse_far_too_long(self, text: str, add_special_tokens: bool, param: str) -> None:
        """A text much longer than the context is refused after tokenizing only its start:
        megabytes cost milliseconds, not seconds of a core. The start alone must hold twice
        the context, a margin no tokenizer's boundary effects come near, so a text that
        could fit is always tokenized whole."""
        probe = self.max_model_len * PROBE_CHARS_PER_TOKEN
        if len(text) <= probe:
            return
        n, _ = self.tokenizer.encode_bounded(text[:probe], 0, add_special_tokens)
        if n > 2 * self.max_model_len:
            raise errors.context_length_exceeded(
                f"This model's maximum context length is {self.max_model_len} tokens, but the {param} has more "
                f"than {n} tokens ({n} in its first {probe} of {len(text)} characters). Shorten the {param}.",
                param)

    def _checked(self, n: int, ids: list[int] | None, param: str) -> list[int]:
        if ids is None:
            raise errors.context_length_exceeded(
                f"This model's maximum context length is {self.max_model_len} tokens, but the {param} has {n} "
                f"tokens. Shorten the {param}.", param)
        return ids

    async def offload(self, fn, *args):
        """fn(*args) in the pool (bounded: 429 beyond `max_pending`)."""
        if self.pending >= self.max_pending:
            raise APIError(429, f"{self.pending} long prompts are being tokenized already; retry shortly",
                           "rate_limit_error", code="tokenizer_busy")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1
