"""A scripted fake OpenAI server for the bench tool's tests (the `fake_server`
fixture in conftest.py starts it; the module has a unique name so that no other
test directory's helper can shadow it).

It is a real aiohttp server on 127.0.0.1 speaking the OpenAI streaming protocol,
but it generates nothing: each request follows a Script (delays, chunk texts, usage,
errors) so the tests know exactly when every chunk left the server. It runs in its
own thread and event loop, so both async tests and the synchronous CLI can use it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict


@dataclass
class Script:
    """What the scripted fake server does for one request (seconds)."""

    status: int = 200
    error_body: Any = None  # body of a non-200 answer: JSON, or plain text if a str
    role_chunk: bool = True  # chat: a role-only chunk, sent at once (carries no token)
    first_delay: float = 0.0  # before the first token chunk
    gap: float = 0.0  # between token chunks
    texts: list[str] = field(default_factory=lambda: ["a", "b", "c"])  # one chunk each
    completion_tokens: int | None = None  # usage chunk; None: no usage chunk at all
    usage_delay: float = 0.0  # after the last token chunk, before the usage chunk
    done: bool = True  # send [DONE]; False: close the stream without it
    error_event: str | None = None  # an error event sent after the token chunks


ScriptFn = Callable[[dict[str, Any], int], Script]
TEMPLATE_TOKENS = 5  # what the fake /tokenize counts for a chat template around the messages


class ScriptedFakeServer:
    def __init__(self, script: ScriptFn):
        self.script = script
        self.requests: list[dict[str, Any]] = []  # {"path", "headers" (case-insensitive), "body"}
        self.tokenize_requests: list[dict[str, Any]] = []  # bodies sent to POST /tokenize
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ScriptedFakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/tokenize", self._tokenize)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize with a toy tokenizer: a BOS and one token per word for a
        prompt; a chat adds TEMPLATE_TOKENS around its messages' words."""
        body = await request.json()
        self.tokenize_requests.append(body)
        if "messages" in body:
            count = TEMPLATE_TOKENS + sum(len(m["content"].split()) for m in body["messages"])
        else:
            count = 1 + len(body["prompt"].split())
        return web.json_response({"count": count, "max_model_len": 4096, "tokens": list(range(count)),
                                  "token_strs": None})

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        index = len(self.requests)
        self.requests.append({"path": request.path, "headers": CIMultiDict(request.headers), "body": body})
        script = self.script(body, index)
        if script.status != 200:
            if isinstance(script.error_body, str):  # e.g. a proxy's plain-text error page
                return web.Response(text=script.error_body, status=script.status)
            return web.json_response(script.error_body, status=script.status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, script, request.path.endswith("chat/completions"))
        finally:
            self.in_flight -= 1

    async def _stream(self, request: web.Request, script: Script, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(data: Any) -> None:
            payload = data if isinstance(data, str) else json.dumps(data)
            await resp.write(f"data: {payload}\n\n".encode())

        def choice(text: str | None, finish: str | None = None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish}
            return {"index": 0, "text": text or "", "finish_reason": finish}

        if chat and script.role_chunk:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(script.first_delay)
        for i, text in enumerate(script.texts):
            if i:
                await asyncio.sleep(script.gap)
            await send({"choices": [choice(text)]})
        if script.error_event is not None:
            await send({"error": {"message": script.error_event, "code": 500}})
            return resp
        await send({"choices": [choice(None, "length")]})  # finish chunk: no token
        if script.completion_tokens is not None:
            await asyncio.sleep(script.usage_delay)
            await send({"choices": [], "usage": {"prompt_tokens": 7,
                                                 "completion_tokens": script.completion_tokens}})
        if script.done:
            await send("[DONE]")
        return resp
