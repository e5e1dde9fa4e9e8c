"""`/v1/responses`: OpenAI's Responses API over the router's chat path.

A request becomes a chat request (router/responses_request.py, responses_items.py), is
rendered, routed, generated and parsed exactly as `/v1/chat/completions` is (one choice),
and its message becomes a `response` object (responses_output.py), or, streamed, the
Responses events built from the chat stream's deltas (responses_stream.py). Finished
responses are kept for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}` in a
bounded in-memory store (responses_store.py) unless `store` is false.
"""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial

from aiohttp import web

from splitserve.router import errors, protocol
from splitserve.router import responses_output as O
from splitserve.router.choice import ChoiceRun
from splitserve.router.dispatch import WorkerFailure
from splitserve.router.errors import APIError
from splitserve.router.responses_request import ResponsesRequest, parse_responses_request, renamed
from splitserve.router.responses_store import ResponseStore, not_found
from splitserve.router.responses_stream import ResponseEvents

log = logging.getLogger(__name__)
INLINE_MESSAGES = 256  # checking this many chat messages takes well under a millisecond


class ResponsesAPI:
    def __init__(self, server, store: ResponseStore):
        self.server = server  # the RouterServer: parsing, the chat prompt, generation
        self.store = store

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        rreq: ResponsesRequest = await server._parse(request, parse_responses_request)
        history = self.store.conversation(rreq.previous_response_id)  # 404 previous_response_not_found
        try:
            body = rreq.chat_body(history)  # a long stored conversation is checked off the event loop
            parse = protocol.parse_chat_request
            req = parse(body) if len(body["messages"]) <= INLINE_MESSAGES else await server.prompts.offload(parse, body)
            prompt, output = await server.chat_prompt(req)
            req.ignored_fields = rreq.ignored_fields
            answer = partial(self._answer, rreq, history, O.new_id("resp"))
            return await server._generate(request, req, prompt, chat=True, output=output, answer=answer)
        except APIError as exc:  # before the answer began (the prompt's length, a schema...)
            raise renamed(exc) from None

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.lookup(request.match_info["response_id"]).response)

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        if not self.store.delete(rid):
            raise not_found(rid)
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    # ---- answering one admitted choice -----------------------------------------------------
    async def _answer(self, rreq: ResponsesRequest, history: list[dict], rid: str, request: web.Request,
                      choices: list[ChoiceRun], headers: dict, deadline: float | None) -> web.StreamResponse:
        (choice,) = choices
        created = O.now()
        if rreq.stream:
            return await self._stream(rreq, history, rid, created, request, choice, headers, deadline)
        await self.server.await_choices(choices, deadline)
        status, incomplete = O.finish_status(choice.finish_reason)
        message = choice.chat.message_dict()
        response = O.response_object(rid, created, rreq, O.output_items(message, status), status,
                                     self._usage(choice, message.get("reasoning_content")), incomplete)
        self._keep(rreq, history, response)
        headers["X-Splitserve-Workers"] = "; ".join(f"{k}={v}" for k, v in choice.served_by.items())
        return web.json_response(response, headers=headers)

    async def _stream(self, rreq, history, rid, created, request, choice: ChoiceRun, headers: dict,
                      deadline: float | None) -> web.StreamResponse:
        stream = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                             "Cache-Control": "no-cache"})
        await stream.prepare(request)
        events = ResponseEvents()
        await _write(stream, events.start(O.response_object(rid, created, rreq, [], "in_progress")))
        chunks = choice.chunks(rreq.model, created, True)
        finish, failure = None, None
        timer = asyncio.timeout_at(deadline)
        try:
            async with timer:
                async for chunk in chunks:
                    (c,) = chunk["choices"]
                    await _write(stream, events.feed(c["delta"]))
                    finish = c["finish_reason"] or finish
        except TimeoutError:
            if not timer.expired():
                raise
            failure = errors.deadline_exceeded(choice.rid, self.server.admission.config.request_timeout_s)
        except WorkerFailure as exc:
            failure = APIError(503, str(exc), "service_unavailable", code="worker_failure")
        except APIError as exc:
            failure = exc
        finally:  # client gone, deadline or done: close the worker stream now
            await chunks.aclose()
        status, incomplete = O.finish_status(finish) if failure is None else ("failed", None)
        await _write(stream, events.finish("incomplete" if status != "completed" else "completed"))
        error = None
        if failure is not None:
            self.server._count_error(failure)
            await _write(stream, events.error(failure.code, failure.message, failure.param))
            error = {"code": "server_error", "message": failure.message}
        reasoning = "".join(i["content"][0]["text"] for i in events.output if i["type"] == "reasoning")
        response = O.response_object(rid, created, rreq, events.output, status,
                                     self._usage(choice, reasoning), incomplete, error)
        await _write(stream, events.end(response))
        if failure is None:
            self._keep(rreq, history, response)
        try:
            await stream.write_eof()
        except ConnectionResetError:  # the client closed after the last event: it has everything
            pass
        return stream

    def _usage(self, choice: ChoiceRun, reasoning: str | None) -> dict:
        """Token counts; reasoning_tokens is the reasoning text re-tokenized (the chat path
        splits text, not tokens: exact but for the tokens at the block's edges)."""
        reasoning_tokens = len(self.server.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return O.usage(len(choice.prompt), len(choice.text.token_ids), choice.cached_tokens, reasoning_tokens)

    def _keep(self, rreq: ResponsesRequest, history: list[dict], response: dict) -> None:
        if rreq.store and not self.store.put(response, history + rreq.items + response["output"]):
            log.warning("response %s is larger than the whole response store (--responses-store-mb): not stored",
                        response["id"])


async def _write(stream: web.StreamResponse, events: list[dict]) -> None:
    if events:
        await stream.write(b"".join(f"event: {e['type']}\ndata: ".encode() + json.dumps(e, ensure_ascii=False).encode()
                                    + b"\n\n" for e in events))
