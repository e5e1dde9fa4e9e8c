"""The router's OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions
(SSE when `stream`), /v1/models, /v1/models/{id}, vLLM's /tokenize and /detokenize
(router/tokenization.py), /health, /metrics, /openapi.json.

Tokenize once here, route by prefix, stream from the decode worker, detokenize here.
Clients are untrusted: bodies are size- and time-limited, validated before anything else,
and tokenized off the event loop when long (router/prompts.py); every client mistake is
an OpenAI-format 4xx and nothing a client sends produces a 5xx. (Over 300 lines: a
request's path from body to stream, with its admission and error mapping, reads in order
here; the pieces that stand alone already live beside it: harmony_chat.py, responses_api.py,
tokenization.py, prompts.py. The next to move out is the chat prompt step shared with
/v1/responses, `chat_prompt` and `_harmony_prompt`.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from splitserve.core.model_config import ModelConfig
from splitserve.core.sampling_params import InvalidSamplingParams
from splitserve.core.tokenizer import Tokenizer
from splitserve.router import errors, harmony, harmony_chat, protocol, tokenization
from splitserve.router import responses as R
from splitserve.router.admission import Admission, AdmissionConfig, check_request_limits
from splitserve.router.chat_output import ChatOutputConfig
from splitserve.router.choice import ChoiceRun
from splitserve.router.dispatch import Dispatcher, WorkerFailure
from splitserve.router.errors import APIError
from splitserve.router.hold_at_zero import HoldConfig, RequestHolder
from splitserve.router.http_limits import (
    HTTPLimits,
    client_request_id,
    expect_continue,
    limit_client_error_logs,
)
from splitserve.router.lora import parse_lora_body, runtime_updates_allowed
from splitserve.router.openapi import openapi_document
from splitserve.router.policy import NoHealthyWorker
from splitserve.router.prompts import INLINE_CHARS, PromptTokenizer
from splitserve.router.request_fields import IGNORED_HEADER, NO_EFFORT, header_value
from splitserve.router.request_tracing import trace_requests
from splitserve.router.responses_api import ResponsesAPI
from splitserve.router.responses_store import ResponseStore, StoreConfig
from splitserve.router.sse import stream_choices
from splitserve.router.structured_fields import check_structured

log = logging.getLogger(__name__)

INLINE_BODY_BYTES = 256 << 10  # parsing a body this large takes a few milliseconds at most
KEYED_PATHS = ("/tokenize", "/detokenize")  # outside /v1/, but they spend the router's CPU: the key guards them
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # --admin-api-key, not --api-key
@dataclass
class ServerConfig:
    model_dir: str
    served_model_name: str
    api_key: str | None = None
    admin_api_key: str | None = None  # runtime LoRA load / unload (ADMIN_PATHS): never the API key
    max_model_len: int | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    limits: HTTPLimits = field(default_factory=HTTPLimits)
    expected_workers: dict[str, int] = field(default_factory=dict)  # `serve`: workers it started, per role
    content_as_text: bool = True  # control-token text in chat messages stays text (core/chat_content.py)
    hold: HoldConfig = field(default_factory=HoldConfig)  # requests held while decode is at zero
    responses_store: StoreConfig = field(default_factory=StoreConfig)  # /v1/responses kept for previous_response_id


class RouterServer:
    def __init__(self, config: ServerConfig, dispatcher: Dispatcher):
        self.config = config
        self.dispatcher = dispatcher
        self.metrics = dispatcher.metrics
        model = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer(config.model_dir, model.eos_token_ids)
        self.vocab_size = model.vocab_size
        self.max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        self.prompts = PromptTokenizer(self.tokenizer, self.max_model_len, content_as_text=config.content_as_text)
        # gpt-oss: chat through openai-harmony (router/harmony_chat.py); its vocabulary is loaded now, so a
        # server that cannot is refused at start rather than at its first request
        self.harmony = harmony.is_harmony(self.tokenizer.token_to_id(harmony.CHANNEL_TOKEN))
        if self.harmony:
            harmony.encoding()
        self.created = int(time.time())
        self.admission = Admission(config.admission)
        self.loras = dispatcher.loras  # LoRA adapters: served names, runtime load / unload (router/lora.py)
        self.runtime_lora = False  # the load / unload routes exist (set by app())
        self.holder = RequestHolder(config.hold, dispatcher.sync.bus, self.metrics.router_held_requests)
        self._openapi = json.dumps(openapi_document(config.served_model_name, self.max_model_len,
                                                    auth=bool(config.api_key))).encode()
        self.responses = ResponsesAPI(self, ResponseStore(config.responses_store))  # /v1/responses

    def app(self) -> web.Application:
        limit_client_error_logs()  # a request aiohttp cannot parse: one rate-limited line, not a traceback
        app = web.Application(middlewares=[trace_requests, self._errors, self._auth],
                              client_max_size=self.config.limits.max_body_bytes)
        # every route answers an Expect header other than 100-continue in OpenAI's error format
        post, get, delete = (partial(add, expect_handler=expect_continue)
                             for add in (app.router.add_post, app.router.add_get, app.router.add_delete))
        post("/v1/completions", self.completions)
        post("/v1/chat/completions", self.chat_completions)
        post("/v1/responses", self.responses.create)
        get("/v1/responses/{response_id}", self.responses.retrieve)
        delete("/v1/responses/{response_id}", self.responses.delete)
        get("/v1/models", self.models)
        get("/v1/models/{model_id:.+}", self.model)  # served names may hold a "/"
        self.runtime_lora = runtime_updates_allowed()  # vLLM's convention: off unless the operator turns it on
        if self.runtime_lora:
            post("/v1/load_lora_adapter", self.load_lora_adapter)
            post("/v1/unload_lora_adapter", self.unload_lora_adapter)
            if self.config.api_key and not self.config.admin_api_key:
                log.warning("runtime LoRA updating is on but no --admin-api-key is set: load / unload are "
                            "refused (403); the API key does not grant them")
        post("/tokenize", self.tokenize)
        post("/detokenize", self.detokenize)
        get("/health", self.health)
        get("/livez", self.livez)
        get("/metrics", self.prometheus)
        get("/openapi.json", self.openapi)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.prompts.close()
        await self.holder.close()

    # ---- middleware ---------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as exc:
            self.metrics.request_errors.labels(model=self.config.served_model_name, code=str(exc.status)).inc()
            resp = web.Response(status=exc.status, body=exc.to_json(), content_type="application/json",
                                headers=getattr(exc, "headers", None))
            if exc.status == 408:  # no keep-alive: the rest of that body may never come
                resp.force_close()
            return resp
        except web.HTTPException as exc:  # 404/405/413 from aiohttp itself, in OpenAI shape
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status == 413:
                message += (f" (the body limit is {self.config.limits.max_body_mb:g} MiB: "
                            "--max-request-body-mb)")
            err = APIError(exc.status, message, "not_found_error" if exc.status == 404 else "invalid_request_error")
            self.metrics.request_errors.labels(model=self.config.served_model_name, code=str(exc.status)).inc()
            return web.Response(status=exc.status, body=err.to_json(), content_type="application/json")
        except asyncio.CancelledError:
            raise  # the client went away (aiohttp cancelled the handler): nothing to answer
        except ConnectionResetError:  # it went away while we wrote: nobody to answer, nothing to log
            return web.Response(status=499)  # nginx's "client closed request"; aiohttp drops it quietly
        except Exception:  # a bug: say so in OpenAI's shape, with the id to find the traceback under
            rid = client_request_id(request) or R.new_request_id(False)
            log.exception("request %s (%s %s) failed with an internal error", rid, request.method, request.path)
            err = errors.server_error(rid)
            self.metrics.request_errors.labels(model=self.config.served_model_name, code="500").inc()
            return web.Response(status=500, body=err.to_json(), content_type="application/json")

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        key = self.config.api_key
        if request.path in ADMIN_PATHS and self.runtime_lora:
            self._admin_auth(request)
        elif key and (request.path.startswith("/v1/") or request.path in KEYED_PATHS):
            if not _bearer_is(request, key):
                raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               "authentication_error", code="invalid_api_key")
        return await handler(request)

    def _admin_auth(self, request: web.Request) -> None:
        """Runtime adapter changes alter what every client is served: they take the admin key.
        With neither key set (an unauthenticated development server) they are open, as all is;
        with only --api-key set they are refused to everyone."""
        admin, key = self.config.admin_api_key, self.config.api_key
        if admin and _bearer_is(request, admin):
            return
        if not admin and not key:
            return
        if key and _bearer_is(request, key):  # a client, known, but not an admin
            raise APIError(403, "Loading and unloading LoRA adapters needs the admin key (--admin-api-key)"
                           + ("" if admin else ", and this server has none") + ", not the API key.",
                           "permission_error", code="insufficient_permissions")
        raise APIError(401, "Incorrect or missing admin key: send 'Authorization: Bearer <admin key>' "
                       "(--admin-api-key).", "authentication_error", code="invalid_api_key")

    # ---- simple endpoints ------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        listing = R.models_list([self.config.served_model_name], self.created)
        listing["data"] += self.loras.model_objects(self.created)  # LoRA adapters, with `parent`
        return web.json_response(listing)

    async def model(self, request: web.Request) -> web.Response:
        requested = request.match_info["model_id"]
        adapter = next((m for m in self.loras.model_objects(self.created) if m["id"] == requested), None)
        if adapter is not None:
            return web.json_response(adapter)
        return web.json_response(tokenization.model_object(self.config.served_model_name, requested, self.created))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        name, path = parse_lora_body(await self._body(request), need_path=True)
        await self.loras.load(name, path)
        log.info("LoRA adapter %s loaded from %r on every worker", name, path)  # %r: a path may hold a newline
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        name, _ = parse_lora_body(await self._body(request), need_path=False)
        await self.loras.unload(name)
        log.info("LoRA adapter %s unloaded from every worker", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self._parse(request, tokenization.parse_tokenize_request)
        return web.json_response(await tokenization.tokenize(self.prompts, req, self.harmony))

    async def detokenize(self, request: web.Request) -> web.Response:
        parse = partial(tokenization.parse_detokenize_request, vocab_size=self.tokenizer.vocab_size,
                        max_tokens=self.max_model_len)
        return web.json_response(await tokenization.detokenize(self.prompts, await self._parse(request, parse)))

    async def health(self, request: web.Request) -> web.Response:
        """200 "ok" when every role has the workers it should; 200 "degraded" when some are
        missing but requests are served; 503 with no decode worker, unless requests are
        held for one (--hold-requests-at-zero: decode scaled to zero)."""
        sync = self.dispatcher.sync
        decode, prefill = sync.live("decode"), sync.live("prefill")
        missing = {role: want - len(have) for role, have, want in (
            ("decode", decode, self.config.expected_workers.get("decode", 0)),
            ("prefill", prefill, self.config.expected_workers.get("prefill", 0))) if len(have) < want}
        status = "no decode workers" if not decode else ("degraded" if missing else "ok")
        # Scaled to zero, requests are held, not refused: stay in the Service's endpoints.
        holding = not decode and self.holder.config.enabled
        if holding:
            status = "scaled to zero: holding requests"
        index = self.dispatcher.index
        body = {"status": status, "decode_workers": sorted(decode), "prefill_workers": sorted(prefill),
                "draining_workers": sorted(sync.draining()),
                "index": {"blocks": index.num_blocks,
                          "per_worker": {w: index.blocks_of(w) for w in sorted(index.workers())}}}
        if missing:
            body["missing_workers"] = missing
        if sync.refused:
            body["refused_workers"] = sorted(sync.refused)
        if request.query.get("index_digest"):  # O(index size): for tests and debugging only
            snap = sorted((h, sorted(ws)) for h, ws in index.snapshot().items())
            body["index"]["digest"] = hashlib.sha256(repr(snap).encode()).hexdigest()
        body["admission"] = self.admission.snapshot()
        if self.holder.config.enabled:
            body["held_at_zero"] = self.holder.held
        return web.json_response(body, status=200 if decode or holding else 503)

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness: this process answers. Missing workers are /health's business (readiness);
        restarting the router would not bring them back."""
        return web.json_response({"status": "alive"})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def prometheus(self, request: web.Request) -> web.Response:
        if "application/openmetrics-text" in request.headers.get("Accept", ""):  # with exemplars: trace links
            from prometheus_client.openmetrics import exposition as om

            return web.Response(body=om.generate_latest(self.metrics.registry),
                                headers={"Content-Type": om.CONTENT_TYPE_LATEST})
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- generation ---------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.config.limits.body_read_timeout_s):
                return await request.read()
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.config.limits.body_read_timeout_s:g}s "
                           "(--body-read-timeout)", "invalid_request_error", code="request_timeout") from None

    async def _parse(self, request: web.Request, parse):
        """The validated request; a body of megabytes (say 300,000 chat messages: 0.7 s of
        parsing) is parsed in the prompt pool, not on the event loop."""
        raw = await self._body(request)

        async def against(served: list[str]):
            return parse(raw, served) if len(raw) <= INLINE_BODY_BYTES else await self.prompts.offload(parse, raw, served)
        return await self.loras.judged(against)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request, protocol.parse_completion_request)
        if req.prompt_token_ids is not None:
            protocol.check_token_ids(req.prompt_token_ids, self.vocab_size)
            prompt = req.prompt_token_ids
        else:
            prompt = await self.prompts.encode(req.prompt)
        return await self._generate(request, req, prompt, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._parse(request, protocol.parse_chat_request)
        prompt, output = await self.chat_prompt(req)
        return await self._generate(request, req, prompt, chat=True, output=output)

    async def chat_prompt(self, req) -> tuple[list[int], ChatOutputConfig | harmony_chat.HarmonyOutputConfig]:
        """A chat request's prompt and how its choices' text becomes messages (chat completions
        and /v1/responses): the chat template and ChatOutput, or harmony for gpt-oss."""
        if self.harmony:
            return await self._harmony_prompt(req)
        if req.reasoning_effort is not None:
            raise errors.unsupported("reasoning_effort", NO_EFFORT)
        prompt = await self.prompts.encode_chat(req.messages_for_template(), tools=req.tools and req.tools.tools,
                                                template_kwargs=req.template_kwargs)
        output = ChatOutputConfig.of(req.tools, self.tokenizer, prompt)
        if output.keep_special_tokens:
            req.params = replace(req.params, skip_special_tokens=False)
        return prompt, output

    async def _harmony_prompt(self, req) -> tuple[list[int], harmony_chat.HarmonyOutputConfig]:
        harmony_chat.check_request(req)
        size = sum(len(m.content or "") for m in req.messages)
        render = partial(harmony_chat.render_request, req)
        prompt = render() if size <= INLINE_CHARS else await self.prompts.offload(render)
        req.params = harmony_chat.with_stop_tokens(req.params)
        return prompt, harmony_chat.HarmonyOutputConfig(req.tools is None or req.tools.parallel)

    async def _generate(self, request: web.Request, req, prompt: list[int], chat: bool,
                        output: ChatOutputConfig | None = None, answer=None) -> web.StreamResponse:
        if not prompt:
            raise errors.invalid_request("the prompt is empty", "prompt")
        if req.params.structured is not None:  # a bad schema is a 400 before routing; compiled off the loop
            await self.prompts.offload(check_structured, req.params.structured)
        max_tokens = protocol.check_prompt_length(len(prompt), req.params.max_tokens, self.max_model_len,
                                                  "messages" if chat else "prompt")
        protocol.check_logit_bias(req.params, self.vocab_size)
        try:
            params = replace(req.params, max_tokens=max_tokens, lora_name=self.loras.lora_name(req.model))
        except InvalidSamplingParams as exc:  # min_tokens beyond what the context leaves
            raise errors.invalid_request(f"{exc} (what the context leaves for the completion)", exc.param,
                                         "invalid_value") from None
        check_request_limits(params)
        rid = R.new_request_id(chat)  # ours, unique; the client's X-Request-Id is only a correlation id
        started = self.admission.enter(rid)  # 429 beyond --max-queued-requests
        try:
            return await self._admitted(request, req, prompt, params, rid, chat, output, answer)
        finally:  # also on client disconnect (the handler is cancelled) and deadline
            self.admission.leave(started)

    async def _decide(self, prompt: list[int], rid: str, lora: str | None = None):
        """The routing decision; with no healthy worker, wait up to --no-worker-wait (within the
        request's deadline) for one, then 503. The client's disconnect cancels the wait."""
        limits = self.config.admission
        if self.holder.config.enabled and not self.dispatcher.sync.live("decode"):  # scaled to zero
            return await self.holder.hold(self.dispatcher, prompt, rid, limits.request_timeout_s, lora)
        wait = min(limits.no_worker_wait_s, limits.request_timeout_s or float("inf"))
        try:
            return await self.dispatcher.decide_waiting(prompt, wait, lambda: log.warning(
                "request %s: no healthy decode worker; waiting up to %.0f s for one to register "
                "(--no-worker-wait)", rid, wait), lora=lora)
        except NoHealthyWorker as exc:
            raise APIError(503, f"{exc}; retry shortly", "service_unavailable", code="no_workers") from None

    async def _admitted(self, request: web.Request, req, prompt: list[int], params, rid: str,
                        chat: bool, output: ChatOutputConfig | None, answer=None) -> web.StreamResponse:
        """Route and answer; `answer(request, choices, headers, deadline)`, when given, writes the
        answer in its own API's shape (/v1/responses) instead of chat's or completions'."""
        decision = await self._decide(prompt, rid, params.lora_name)
        client_id = client_request_id(request)
        log.info("request %s%s: %d prompt tokens -> %s", rid, f" (client id {client_id})" if client_id else "",
                 len(prompt), decision.header_value())
        headers = {"X-Request-Id": client_id or rid, "X-Splitserve-Request-Id": rid,
                   "X-Splitserve-Route": decision.header_value()}
        if req.ignored_fields:
            headers[IGNORED_HEADER] = header_value(req.ignored_fields)
        choices = [ChoiceRun(self, rid, i, prompt, self._choice_params(params, i), decision,
                             output.new() if output is not None else None) for i in range(params.n)]
        if getattr(req, "echo", False):  # the prompt as the client sent it, or its ids decoded
            echo = req.prompt if req.prompt is not None else self.tokenizer.decode(prompt, skip_special_tokens=False)
            for c in choices:
                c.echo_text = echo
        timeout = self.admission.config.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        if answer is not None:
            return await answer(request, choices, headers, deadline)
        if req.stream:
            # under an adapter the 200 waits for the worker's first reply: one unloaded meanwhile is a 404
            return await stream_choices(request, req, choices, chat, headers, deadline,
                                        self.admission.config.request_timeout_s, self._count_error,
                                        hold=params.lora_name is not None)
        await self.await_choices(choices, deadline)
        usage = R.Usage(len(prompt), sum(len(c.text.token_ids) for c in choices), choices[0].cached_tokens)
        body_choices = [R.Choice(c.index, c.echo_text + c.text.text, c.chat.finish_reason(c.finish_reason) if c.chat
                                 else c.finish_reason, c.logprobs_out(chat) if c.want_logprobs else None,
                                 c.chat.message_dict() if c.chat else None) for c in choices]
        build = R.chat_completion_response if chat else R.completion_response
        headers["X-Splitserve-Workers"] = "; ".join(f"{k}={v}" for k, v in choices[0].served_by.items())
        return web.json_response(build(rid, req.model, R.now(), body_choices, usage), headers=headers)

    async def await_choices(self, choices: list[ChoiceRun], deadline: float | None) -> None:
        """Run the choices to their end: 503 when no worker can finish them, 504 past the deadline."""
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.gather(*(c.run_to_end() for c in choices))
        except WorkerFailure as exc:
            raise APIError(503, str(exc), "service_unavailable", code="worker_failure") from None
        except TimeoutError:
            raise errors.deadline_exceeded(choices[0].rid, self.admission.config.request_timeout_s) from None

    def _count_error(self, err: APIError) -> None:
        """An error after the 200 went out (an SSE error event), counted like any error answer."""
        self.metrics.request_errors.labels(model=self.config.served_model_name, code=str(err.status)).inc()

    @staticmethod
    def _choice_params(params, index: int):
        seed = None if params.seed is None else params.seed + index
        return replace(params, n=1, seed=seed)


def _bearer_is(request: web.Request, key: str) -> bool:
    """Whether the request's `Authorization: Bearer` token is `key`, compared in constant time
    (a wrong guess does not reveal how much of it matched). aiohttp keeps undecodable header
    bytes as surrogates: encode them back, never fail."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given_bytes, key.encode()) and scheme.lower() == "bearer"
