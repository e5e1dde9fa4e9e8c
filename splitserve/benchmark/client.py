"""The thin I/O layer: one streamed OpenAI request, timed on arrival of each chunk.

It records raw timestamps (send, every token-carrying chunk, [DONE]); metrics.py
turns them into TTFT/ITL/TPOT/E2E. Every failure (HTTP status, error event inside
the stream, truncated stream, connection error, timeout) becomes a failed
RequestResult with the status and the server's message: a run never crashes on a
bad request.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from splitserve.benchmark.request import RequestResult
from splitserve.benchmark.sse import SSEDecoder

MAX_ERROR_CHARS = 300


@dataclass
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    include_usage: bool = True  # ask for stream_options.include_usage
    timeout_s: float = 3600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def build_payload(cfg: ClientConfig, prompt: list[int] | str | list[dict[str, str]],
                  max_tokens: int) -> dict[str, Any]:
    """Chat endpoints take `prompt` as the message list; completions take ids or text."""
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": max_tokens,
                            "temperature": cfg.temperature, "stream": True}
    body["messages" if cfg.is_chat else "prompt"] = prompt
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang/splitserve extension; OpenAI ignores it
    body.update(cfg.extra_body)
    return body


def error_message(body: str) -> str:
    """The server's own words: OpenAI `{"error": {"message"}}`, vLLM `{"message"}`,
    FastAPI `{"detail"}`, or the raw body, shortened."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:MAX_ERROR_CHARS] or "(empty body)"
    if isinstance(data, str) and data:
        return data[:MAX_ERROR_CHARS]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:MAX_ERROR_CHARS]
        for key in ("message", "detail", "error"):
            if data.get(key):
                return str(data[key])[:MAX_ERROR_CHARS]
    return body.strip()[:MAX_ERROR_CHARS]


def chunk_text(data: dict[str, Any], chat: bool) -> str:
    """The generated text a chunk carries; '' for role-only, finish-only and usage chunks."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # reasoning models stream their thinking in a separate field; it is output too
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


class _StreamState:
    """Applies decoded events to a RequestResult; returns True once [DONE] is seen."""

    def __init__(self, result: RequestResult, chat: bool):
        self.result, self.chat = result, chat
        self.usage: dict[str, Any] | None = None

    def apply(self, payload: str, now: float) -> bool:
        r = self.result
        if payload.strip() == "[DONE]":
            r.end = now
            return True
        try:
            data = json.loads(payload)
        except ValueError:
            r.error = f"malformed stream chunk: {payload[:MAX_ERROR_CHARS]!r}"
            return True
        if not isinstance(data, dict):
            r.error = f"malformed stream chunk: {payload[:MAX_ERROR_CHARS]!r}"
            return True
        if "error" in data or data.get("object") == "error":
            r.error = "error event in stream: " + error_message(payload)
            return True
        if data.get("usage"):
            self.usage = data["usage"]
        text = chunk_text(data, self.chat)
        if text:
            r.token_times.append(now)
            r.generated_text += text
        return False

    def finish(self) -> None:
        r = self.result
        if r.error:
            return
        if r.end is None:
            r.error = (f"stream ended before [DONE] after {r.chunk_count} token chunks "
                       "(server closed the connection mid-response?)")
            return
        r.success = True
        r.output_tokens = r.chunk_count
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            r.output_tokens = self.usage["completion_tokens"]
            r.output_tokens_source = "usage"
        if self.usage and isinstance(self.usage.get("prompt_tokens"), int):
            r.prompt_tokens = self.usage["prompt_tokens"]
            r.prompt_tokens_source = "usage"


def exception_message(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"TimeoutError: no complete answer within {timeout_s:g}s (--request-timeout)"
    detail = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {detail}"[:MAX_ERROR_CHARS] if detail else name


def make_session(cfg: ClientConfig) -> aiohttp.ClientSession:
    # No connection cap here: --max-concurrency is the only limit on requests in flight.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=cfg.timeout_s))


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig,
                       request_id: str, prompt: list[int] | str | list[dict[str, str]],
                       max_tokens: int, prompt_len_estimate: int) -> RequestResult:
    result = RequestResult(request_id, prompt_tokens=prompt_len_estimate)
    headers = {"X-Request-Id": request_id}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    payload = build_payload(cfg, prompt, max_tokens)
    state = _StreamState(result, cfg.is_chat)
    result.start = time.perf_counter()
    try:
        async with session.post(cfg.url, json=payload, headers=headers) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error = error_message(await resp.text())
                return result
            if resp.content_type == "application/json":
                result.error = ("server answered with JSON instead of an event stream: "
                                + (await resp.text())[:MAX_ERROR_CHARS])
                return result
            decoder, done = SSEDecoder(), False
            async for piece in resp.content.iter_any():
                now = time.perf_counter()
                for event in decoder.feed(piece):
                    if state.apply(event, now):
                        done = True
                        break
                if done:
                    break
            if not done:
                now = time.perf_counter()
                for event in decoder.close():
                    if state.apply(event, now):
                        break
    except Exception as exc:  # noqa: BLE001 - any failure is a counted error, never a crash
        result.error = exception_message(exc, cfg.timeout_s)
        return result
    state.finish()
    return result
