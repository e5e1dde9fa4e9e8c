"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP,
so a client counts tokens exactly as this server does (BOS, chat template included).

Request and response fields are vLLM's:
  /tokenize   {"model"?, "prompt", "add_special_tokens"? (true), "return_token_strs"? (false)}
              or {"model"?, "messages", "add_generation_prompt"? (true),
                  "add_special_tokens"? (false), "return_token_strs"? (false)}
              -> {"count", "max_model_len", "tokens", "token_strs" (null unless asked)}
  /detokenize {"model"?, "tokens"} -> {"prompt"}

Messages go through the chat request's own parser and the same template rendering as
/v1/chat/completions, so the count is the prompt_tokens a chat request would report; for a
harmony (gpt-oss) model that is openai-harmony's rendering (router/harmony.py), with the
request's `reasoning_effort` (refused for other models, as by chat completions).
The router's limits hold: a text longer than the context is refused (the message says
how long it is), long inputs are tokenized and decoded in the prompt pool, and every bad
input is an OpenAI-format 4xx. vLLM's chat options that change the rendering and that
/v1/chat/completions does not take either (`continue_final_message`, a client-sent
`chat_template`, ...) are refused with 400 `unsupported_parameter`, never ignored.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial

from splitserve.core.tokenizer import Tokenizer
from splitserve.router import errors, harmony, protocol
from splitserve.router import json_body as J
from splitserve.router import responses as R
from splitserve.router.prompts import INLINE_CHARS, PromptTokenizer
from splitserve.router.request_fields import NO_EFFORT

INLINE_IDS = 8192  # fewer ids than this are decoded on the event loop (well under a millisecond)
# vLLM's chat-only options that change the rendered prompt; refused when used.
_REFUSED_CHAT_OPTIONS = ("continue_final_message", "chat_template", "chat_template_kwargs", "tools",
                         "documents", "mm_processor_kwargs", "media_io_kwargs")


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None  # exactly one of prompt / messages
    messages: list[dict] | None  # as the chat template takes them
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    reasoning_effort: str | None = None  # harmony models only


def parse_tokenize_request(raw: bytes | str | dict, served: Collection[str]) -> TokenizeRequest:
    body = J.load(raw)
    model = _model(body, served)
    strs = J.opt_bool(body, "return_token_strs", default=False)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise errors.invalid_request("send either 'prompt' (a text) or 'messages' (a chat), not both", "prompt")
        for name in _REFUSED_CHAT_OPTIONS:
            if body.get(name):
                raise errors.unsupported(name, "/tokenize renders messages exactly as /v1/chat/completions "
                                         "does; remove it from the request")
        effort = {"reasoning_effort": body["reasoning_effort"]} if "reasoning_effort" in body else {}
        chat = protocol.parse_chat_request({"model": model, "messages": body["messages"], **effort}, served)
        return TokenizeRequest(None, chat.messages_for_template(),
                               J.opt_bool(body, "add_special_tokens", default=False),
                               J.opt_bool(body, "add_generation_prompt", default=True), strs, chat.reasoning_effort)
    prompt = body.get("prompt")
    if prompt is None:
        raise errors.invalid_request("send 'prompt' (a text) or 'messages' (a chat) to tokenize", "prompt",
                                     "missing_required_parameter")
    if not isinstance(prompt, str):
        raise errors.wrong_type("prompt", "a string (send 'messages' to tokenize a chat)", prompt)
    return TokenizeRequest(prompt, None, J.opt_bool(body, "add_special_tokens", default=True), True, strs)


def parse_detokenize_request(raw: bytes | str | dict, served: Collection[str], vocab_size: int,
                             max_tokens: int) -> list[int]:
    """The token ids to decode: at most `max_tokens` (the context), each in the vocabulary."""
    body = J.load(raw)
    _model(body, served)
    tokens = body.get("tokens")
    if tokens is None:
        raise errors.missing_parameter("tokens")
    if not isinstance(tokens, list):
        raise errors.wrong_type("tokens", "an array of token ids", tokens)
    if len(tokens) > max_tokens:
        raise errors.invalid_request(f"'tokens' has {len(tokens)} ids; at most {max_tokens} (the context length) "
                                     "are decoded at once", "tokens", "invalid_value")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise errors.wrong_type(f"tokens[{i}]", "a token id (a non-negative integer)", t)
        if t >= vocab_size:
            raise errors.invalid_request(f"token id {t} (tokens[{i}]) is out of range: the vocabulary has "
                                         f"{vocab_size} tokens", "tokens", "invalid_value")
    return tokens


async def tokenize(prompts: PromptTokenizer, req: TokenizeRequest, harmony_model: bool = False) -> dict:
    if req.messages is not None and harmony_model:
        ids = await _harmony_ids(prompts, req)
    elif req.messages is not None:
        if req.reasoning_effort is not None:
            raise errors.unsupported("reasoning_effort", NO_EFFORT)
        ids = await prompts.encode_chat(req.messages, req.add_generation_prompt, req.add_special_tokens)
    else:
        ids = await prompts.encode(req.prompt, "prompt", req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = (token_strings(prompts.tokenizer, ids) if len(ids) <= INLINE_IDS
                else await prompts.offload(token_strings, prompts.tokenizer, ids))
    return {"count": len(ids), "max_model_len": prompts.max_model_len, "tokens": ids, "token_strs": strs}


async def _harmony_ids(prompts: PromptTokenizer, req: TokenizeRequest) -> list[int]:
    if req.reasoning_effort is not None and req.reasoning_effort not in harmony.EFFORTS:
        raise errors.invalid_request(f"'reasoning_effort' must be low, medium or high for gpt-oss models, got "
                                     f"{req.reasoning_effort!r}", "reasoning_effort", "invalid_value")
    render = partial(harmony.render, req.messages, None, req.reasoning_effort,
                     add_generation_prompt=req.add_generation_prompt)
    try:
        ids = render() if sum(len(m.get("content") or "") for m in req.messages) <= INLINE_CHARS \
            else await prompts.offload(render)
    except ValueError as exc:
        raise errors.invalid_request(str(exc), "messages") from None
    if len(ids) > prompts.max_model_len:
        raise errors.context_length_exceeded(
            f"This model's maximum context length is {prompts.max_model_len} tokens, but the messages have "
            f"{len(ids)} tokens. Shorten the messages.", "messages")
    return ids


async def detokenize(prompts: PromptTokenizer, ids: list[int]) -> dict:
    if len(ids) <= INLINE_IDS:
        return {"prompt": prompts.tokenizer.decode(ids, skip_special_tokens=False)}
    return {"prompt": await prompts.offload(prompts.tokenizer.decode, ids, False)}


def token_strings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The vocabulary's spelling of each id (`Ġword`, `▁word`, `<0x0A>`), as vLLM returns them."""
    return [tokenizer.id_to_token(i) for i in ids]


def model_object(served: str, requested: str, created: int) -> dict:
    """GET /v1/models/{id}: OpenAI's model object for the served model; 404 for any other id."""
    if requested != served:
        raise errors.model_not_found(requested, [served])
    return R.models_list([served], created)["data"][0]  # the same object as in GET /v1/models


def _model(body: dict, served: Collection[str]) -> str:
    """vLLM makes `model` optional here: absent means the served model."""
    model = body.get("model")
    if model is None:
        return next(iter(served))
    if not isinstance(model, str):
        raise errors.wrong_type("model", "a string", model)
    if model not in served:
        raise errors.model_not_found(model, sorted(served))
    return model
