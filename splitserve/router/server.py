"""The router's OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions
(SSE when `stream`), /v1/models, /health, /metrics, /openapi.json.

Tokenize once here, route by prefix, stream from the decode worker, detokenize here.
Client mistakes get OpenAI-format 4xx errors; nothing a client sends produces a 5xx.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field, replace

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitserve.engine.config import ModelConfig
from splitserve.engine.tokenizer import ChatTemplateError, Tokenizer
from splitserve.router import errors, protocol
from splitserve.router import responses as R
from splitserve.router.admission import Admission, AdmissionConfig, check_request_limits
from splitserve.router.dispatch import Dispatcher, WorkerFailure
from splitserve.router.errors import APIError
from splitserve.router.openapi import openapi_document
from splitserve.router.policy import NoHealthyWorker
from splitserve.router.text_output import TextAssembler

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model_dir: str
    served_model_name: str
    api_key: str | None = None
    max_model_len: int | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)


class RouterServer:
    def __init__(self, config: ServerConfig, dispatcher: Dispatcher):
        self.config = config
        self.dispatcher = dispatcher
        self.metrics = dispatcher.metrics
        model = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer(config.model_dir, model.eos_token_ids)
        self.vocab_size = model.vocab_size
        self.max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        self.created = int(time.time())
        self.admission = Admission(config.admission)
        self._openapi = json.dumps(openapi_document(config.served_model_name, self.max_model_len,
                                                    auth=bool(config.api_key))).encode()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    # ---- middleware ---------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as exc:
            self.metrics.request_errors.labels(model=self.config.served_model_name, code=str(exc.status)).inc()
            return web.Response(status=exc.status, body=exc.to_json(), content_type="application/json",
                                headers=getattr(exc, "headers", None))
        except web.HTTPException as exc:  # 404/405/413 from aiohttp itself, in OpenAI shape
            err = APIError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                           "not_found_error" if exc.status == 404 else "invalid_request_error")
            return web.Response(status=exc.status, body=err.to_json(), content_type="application/json")
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the client went away: nothing to answer
        except Exception:  # a bug: say so in OpenAI's shape, with the id to find the traceback under
            rid = request.headers.get("X-Request-Id") or R.new_request_id(False)
            log.exception("request %s (%s %s) failed with an internal error", rid, request.method, request.path)
            err = errors.server_error(rid)
            self.metrics.request_errors.labels(model=self.config.served_model_name, code="500").inc()
            return web.Response(status=500, body=err.to_json(), content_type="application/json")

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key = self.config.api_key
        if key and request.path.startswith("/v1/"):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # compare_digest: constant time, a wrong guess does not reveal how much of it matched
            # (aiohttp keeps undecodable header bytes as surrogates: encode them back, never fail)
            given_bytes = given.strip().encode("utf-8", "surrogateescape")
            if not (hmac.compare_digest(given_bytes, key.encode()) and scheme.lower() == "bearer"):
                raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               "authentication_error", code="invalid_api_key")
        return await handler(request)

    # ---- simple endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(R.models_list([self.config.served_model_name], self.created))

    async def health(self, request: web.Request) -> web.Response:
        decode = self.dispatcher.sync.live("decode")
        index = self.dispatcher.index
        body = {"status": "ok" if decode else "no decode workers", "decode_workers": sorted(decode),
                "prefill_workers": sorted(self.dispatcher.sync.live("prefill")),
                "index": {"blocks": index.num_blocks,
                          "per_worker": {w: index.blocks_of(w) for w in sorted(index.workers())}}}
        if request.query.get("index_digest"):  # O(index size): for tests and debugging only
            snap = sorted((h, sorted(ws)) for h, ws in index.snapshot().items())
            body["index"]["digest"] = hashlib.sha256(repr(snap).encode()).hexdigest()
        body["admission"] = self.admission.snapshot()
        return web.json_response(body, status=200 if decode else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- generation ---------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_completion_request(await request.read(), [self.config.served_model_name])
        if req.prompt_token_ids is not None:
            protocol.check_token_ids(req.prompt_token_ids, self.vocab_size)
            prompt = req.prompt_token_ids
        else:
            prompt = self.tokenizer.encode(req.prompt)
        return await self._generate(request, req, prompt, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = protocol.parse_chat_request(await request.read(), [self.config.served_model_name])
        try:
            prompt = self.tokenizer.encode_chat(req.messages_for_template())
        except ChatTemplateError as exc:
            raise errors.invalid_request(str(exc), "messages") from None
        return await self._generate(request, req, prompt, chat=True)

    async def _generate(self, request: web.Request, req, prompt: list[int], chat: bool) -> web.StreamResponse:
        if not prompt:
            raise errors.invalid_request("the prompt is empty", "prompt")
        max_tokens = protocol.check_prompt_length(len(prompt), req.params.max_tokens, self.max_model_len,
                                                  "messages" if chat else "prompt")
        params = replace(req.params, max_tokens=max_tokens)
        check_request_limits(params)
        rid = request.headers.get("X-Request-Id") or R.new_request_id(chat)
        started = self.admission.enter(rid)  # 429 beyond --max-queued-requests
        try:
            return await self._admitted(request, req, prompt, params, rid, chat)
        finally:  # also on client disconnect (the handler is cancelled) and deadline
            self.admission.leave(started)

    async def _admitted(self, request: web.Request, req, prompt: list[int], params, rid: str,
                        chat: bool) -> web.StreamResponse:
        try:
            decision, _ = self.dispatcher.decide(prompt)
        except NoHealthyWorker as exc:
            raise APIError(503, f"{exc}; retry shortly", "service_unavailable", code="no_workers") from None
        log.info("request %s: %d prompt tokens -> %s", rid, len(prompt), decision.header_value())
        headers = {"X-Request-Id": rid, "X-Splitserve-Route": decision.header_value()}
        choices = [ChoiceRun(self, rid, i, prompt, self._choice_params(params, i), decision)
                   for i in range(params.n)]
        timeout = self.admission.config.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        if req.stream:
            return await self._stream(request, req, choices, chat, headers, deadline)
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.gather(*(c.run_to_end() for c in choices))
        except WorkerFailure as exc:
            raise APIError(503, str(exc), "service_unavailable", code="worker_failure") from None
        except TimeoutError:
            raise deadline_exceeded(rid, timeout) from None
        usage = R.Usage(len(prompt), sum(len(c.text.token_ids) for c in choices), choices[0].cached_tokens)
        body_choices = [R.Choice(c.index, c.text.text, c.finish_reason, c.logprobs_out(chat) if c.want_logprobs
                                 else None) for c in choices]
        build = R.chat_completion_response if chat else R.completion_response
        headers["X-Splitserve-Workers"] = "; ".join(f"{k}={v}" for k, v in choices[0].served_by.items())
        return web.json_response(build(rid, req.model, now_s(), body_choices, usage), headers=headers)

    @staticmethod
    def _choice_params(params, index: int):
        seed = None if params.seed is None else params.seed + index
        return replace(params, n=1, seed=seed)

    async def _stream(self, request, req, choices: list[ChoiceRun], chat: bool, headers,
                      deadline: float | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = now_s()
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
                    await resp.write(R.sse_error(deadline_exceeded(choices[0].rid,
                                                                   self.admission.config.request_timeout_s)))
                    break
                if item is None:
                    remaining -= 1
                elif isinstance(item, APIError):
                    await resp.write(R.sse_error(item))
                else:
                    await resp.write(R.sse(item))
            if req.include_usage and not remaining:
                usage = R.Usage(len(choices[0].prompt), sum(len(c.text.token_ids) for c in choices),
                                choices[0].cached_tokens)
                await resp.write(R.sse(R.usage_chunk(choices[0].rid, req.model, created, usage, chat)))
            await resp.write(R.SSE_DONE)
        finally:  # client gone (ConnectionResetError) or done: stop every choice's worker stream
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await resp.write_eof()
        return resp


class ChoiceRun:
    """One choice of a request: its worker stream, text, logprobs and latency metrics."""

    def __init__(self, server: RouterServer, rid: str, index: int, prompt: list[int], params, decision):
        self.server, self.rid, self.index, self.prompt, self.params = server, rid, index, prompt, params
        self.decision = decision
        self.text = TextAssembler(server.tokenizer, list(params.stop), params.skip_special_tokens)
        self.want_logprobs = params.logprobs is not None
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.served_by: dict[str, str | int] = {}  # who actually served it (after any migration)
        self.start = time.monotonic()

    async def events(self):
        """(text delta, new logprobs, finish_reason) per worker chunk."""
        m, model = self.server.metrics, self.server.config.served_model_name
        sub_id = self.rid if self.index == 0 else f"{self.rid}-{self.index}"
        last = None
        async for ev in self.server.dispatcher.generate(sub_id, self.prompt, self.params, self.decision):
            now = time.monotonic()
            if ev.decode_worker:  # first chunk from a (possibly new) decode worker
                self.served_by = {"decode": ev.decode_worker, "prefill": ev.prefill_worker,
                                  "decode_cached": ev.num_cached_tokens, "prefill_cached": ev.prefill_cached_tokens}
            if last is None:
                self.cached_tokens = ev.num_cached_tokens
                m.time_to_first_token.labels(model=model).observe(now - self.start)
            elif ev.token_ids:
                m.inter_token_latency.labels(model=model).observe(now - last)
            last = now
            delta = self.text.add(ev.token_ids, final=ev.finish_reason is not None)
            self.logprobs.extend(ev.logprobs)
            finish = "stop" if delta.stopped else ev.finish_reason
            yield delta.text, ev.logprobs, finish
            if finish is not None:
                self.finish_reason = finish
                m.e2e_request_latency.labels(model=model).observe(now - self.start)
                m.request_success.labels(model=model, finish_reason=finish).inc()
                m.generation_tokens.labels(model=model).inc(len(self.text.token_ids))
                m.prompt_tokens.labels(model=model).inc(len(self.prompt))
                return  # a stop string ends the stream here; the worker call is cancelled

    async def run_to_end(self) -> None:
        async for _ in self.events():
            pass

    def logprobs_out(self, chat: bool) -> list[R.TokenLogprob]:  # same entries; the shape differs later
        return [self._token_logprob(lp) for lp in self.logprobs]

    def _token_logprob(self, lp) -> R.TokenLogprob:
        tok = self.server.tokenizer
        return R.TokenLogprob(tok.decode([lp.token_id], skip_special_tokens=False), lp.logprob,
                              [(tok.decode([t], skip_special_tokens=False), v) for t, v in lp.top])

    async def chunks(self, model: str, created: int, chat: bool):
        first = True
        offset = 0
        pending: list = []  # logprobs of tokens whose text is held back: sent with the next chunk
        async for text, lps, finish in self.events():
            pending.extend(lps)
            if not text and finish is None and not first:
                continue  # nothing visible yet (held back, or an incomplete character)
            lps, pending = pending, []
            lp_out = [self._token_logprob(lp) for lp in lps] if self.want_logprobs else None
            if chat:
                yield R.chat_chunk(self.rid, model, created, self.index, text if text or not first else "",
                                   finish, lp_out, first=first)
            else:
                yield R.completion_chunk(self.rid, model, created, self.index, text, finish, lp_out, offset)
            offset += len(text)
            first = False


def deadline_exceeded(rid: str, timeout: float | None) -> APIError:
    return APIError(504, f"request {rid} did not finish within its deadline of {timeout}s (--request-timeout); "
                    "it was aborted on every worker. Ask for fewer tokens or retry later.", "timeout_error",
                    code="request_timeout")


def now_s() -> int:
    return int(time.time())
