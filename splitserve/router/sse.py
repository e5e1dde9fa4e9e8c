"""A streaming answer: every choice's chunks as server-sent events, as they come."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from splitserve.router import errors
from splitserve.router import responses as R
from splitserve.router.choice import ChoiceRun
from splitserve.router.dispatch import WorkerFailure
from splitserve.router.errors import APIError


class _Response:
    """The stream's response; with `hold`, its 200 goes out with the first chunk, so an error
    before any (a request under a LoRA adapter unloaded meanwhile: 404) is the HTTP status."""

    def __init__(self, request: web.Request, resp: web.StreamResponse):
        self.request, self.resp = request, resp

    @property
    def prepared(self) -> bool:
        return self.resp.prepared

    async def write(self, data: bytes) -> None:
        if not self.resp.prepared:
            await self.resp.prepare(self.request)
        await self.resp.write(data)


async def stream_choices(request: web.Request, req, choices: list[ChoiceRun], chat: bool, headers: dict,
                         deadline: float | None, timeout_s: float | None,
                         count_error: Callable[[APIError], None], hold: bool = False) -> web.StreamResponse:
    """The choices' chunks as server-sent events as they come; an error after the 200 is an
    error event (counted by `count_error`), then usage and [DONE]; a deadline ends it all.
    `hold`: no 200 before the first chunk; an error before it is raised (an HTTP error)."""
    stream = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                         "Cache-Control": "no-cache"})
    resp = _Response(request, stream)
    if not hold:
        await stream.prepare(request)
    created = R.now()
    run = _stream_one if len(choices) == 1 else _stream_many  # one: no pump task and queue hop per token
    await run(resp, req, choices, chat, created, deadline, timeout_s, count_error)
    try:
        await stream.write_eof()
    except ConnectionResetError:  # the client closed after [DONE]: it has everything
        pass
    return stream


async def _stream_one(resp, req, choices: list[ChoiceRun], chat: bool, created: int, deadline: float | None,
                      timeout_s: float | None, count_error) -> None:
    """One choice, read in this task: a task switch, a queue and a timer less per token (the
    deadline is one timer for the whole stream). Same events as `_stream_many`."""
    choice = choices[0]
    chunks = choice.chunks(req.model, created, chat)
    timer = asyncio.timeout_at(deadline)
    try:
        async with timer:
            async for item in chunks:
                if req.continuous_usage:  # vLLM's continuous_usage_stats: usage so far in every chunk
                    item = {**item, "usage": _usage(choices).to_dict()}
                await resp.write(R.sse(item))
    except TimeoutError:  # the deadline passed: the worker stream is closed below, tell the client
        if not timer.expired():
            raise
        await _error_event(resp, errors.deadline_exceeded(choice.rid, timeout_s), count_error)
        await resp.write(R.SSE_DONE)
        return
    except WorkerFailure as exc:
        await _error_event(resp, APIError(503, str(exc), "service_unavailable", code="worker_failure"), count_error)
    except APIError as exc:
        await _error_event(resp, exc, count_error)
    finally:  # client gone (ConnectionResetError), deadline or done: close the worker stream now
        await chunks.aclose()
    if req.include_usage:
        await resp.write(R.sse(R.usage_chunk(choice.rid, req.model, created, _usage(choices), chat)))
    await resp.write(R.SSE_DONE)


async def _stream_many(resp, req, choices: list[ChoiceRun], chat: bool, created: int, deadline: float | None,
                       timeout_s: float | None, count_error) -> None:
    """Several choices (n > 1): each read by a task of its own into one queue, written as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: ChoiceRun):
        try:
            async for payload in choice.chunks(req.model, created, chat):
                await queue.put(payload)
        except WorkerFailure as exc:
            await queue.put(APIError(503, str(exc), "service_unavailable", code="worker_failure"))
        except APIError as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(tasks)
        while remaining:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await queue.get()
            except TimeoutError:  # the deadline passed: stop the workers, tell the client, end the stream
                for t in tasks:
                    t.cancel()
                await _error_event(resp, errors.deadline_exceeded(choices[0].rid, timeout_s), count_error)
                break
            if item is None:
                remaining -= 1
            elif isinstance(item, APIError):
                await _error_event(resp, item, count_error)
            else:
                if req.continuous_usage:  # vLLM's continuous_usage_stats: usage so far in every chunk
                    item = {**item, "usage": _usage(choices).to_dict()}
                await resp.write(R.sse(item))
        if req.include_usage and not remaining:
            await resp.write(R.sse(R.usage_chunk(choices[0].rid, req.model, created, _usage(choices), chat)))
        await resp.write(R.SSE_DONE)
    finally:  # client gone (ConnectionResetError) or done: stop every choice's worker stream
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(choices: list[ChoiceRun]) -> R.Usage:
    return R.Usage(len(choices[0].prompt), sum(len(c.text.token_ids) for c in choices), choices[0].cached_tokens)


async def _error_event(resp: _Response, err: APIError, count_error: Callable[[APIError], None]) -> None:
    if not resp.prepared:  # held, nothing sent yet: the error is the answer (the server counts it)
        raise err
    count_error(err)
    await resp.write(R.sse_error(err))
