"""OpenAI `/v1/completions` and `/v1/chat/completions` request bodies → typed requests.

Validation happens here, before any tokenization or routing, and every rejection is an
`APIError` 4xx naming the parameter. Unknown fields are accepted and ignored (other
routers and SDKs add their own); known OpenAI fields this server cannot honour are
rejected rather than silently ignored, because ignoring them would change the answer the
client expects (router/request_fields.py). Structured outputs are read by
router/structured_fields.py, tools by router/tools.py.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from splitserve.core.context import ContextLengthError, completion_budget
from splitserve.core.sampling_params import InvalidSamplingParams, SamplingParams
from splitserve.router import errors
from splitserve.router import json_body as J
from splitserve.router.admission import n_limit_message
from splitserve.router.chat_messages import ChatMessage, parse_messages
from splitserve.router.request_fields import check_fields
from splitserve.router.structured_fields import parse_structured
from splitserve.router.tools import ToolRequest, parse_tools

MAX_LOGPROBS = 20


@dataclass
class CompletionRequest:
    model: str
    prompt: str | None  # exactly one of prompt / prompt_token_ids is set
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    ignored_fields: list[str] = field(default_factory=list)  # unknown fields (request_fields.py)
    continuous_usage: bool = False  # usage so far in every streamed chunk (vLLM's continuous_usage_stats)
    reasoning_effort: str | None = None  # harmony (gpt-oss) models only: the server refuses it for others
    echo: bool = False  # the prompt text before the completion (completions only)


@dataclass
class ChatRequest:
    model: str
    messages: list[ChatMessage]
    params: SamplingParams  # params.logprobs: None, or top_logprobs (0 = chosen token only)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    ignored_fields: list[str] = field(default_factory=list)  # unknown fields (request_fields.py)
    tools: ToolRequest | None = None
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs, e.g. enable_thinking
    continuous_usage: bool = False  # usage so far in every streamed chunk (vLLM's continuous_usage_stats)

    @property
    def logprobs(self) -> bool:
        return self.params.logprobs is not None

    def messages_for_template(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


def parse_completion_request(raw: bytes | str | dict,
                             served_models: Collection[str] | None = None) -> CompletionRequest:
    body = J.load(raw)
    model = model_field(body, served_models)
    prompt, token_ids = _prompt(body)
    ignored = check_fields(body, "completions")
    logprobs = J.opt_int(body, "logprobs")
    params = _sampling(body, max_tokens=J.opt_int(body, "max_tokens", default=16),
                       max_tokens_param="max_tokens", logprobs=logprobs)
    params = replace(params, structured=parse_structured(body, chat=False))
    stream, include_usage = _stream(body)
    req = CompletionRequest(model, prompt, token_ids, params, stream, include_usage, J.opt_str(body, "user"), ignored)
    req.continuous_usage = _continuous_usage(body, include_usage)
    req.echo = J.opt_bool(body, "echo", default=False)
    if req.echo and logprobs is not None:
        raise errors.unsupported("echo", "echo together with logprobs (the prompt's own logprobs) is not "
                                 "implemented; ask for one of them")
    return req


def parse_chat_request(raw: bytes | str | dict,
                       served_models: Collection[str] | None = None) -> ChatRequest:
    body = J.load(raw)
    model = model_field(body, served_models)
    messages = parse_messages(body)
    ignored = check_fields(body, "chat")
    want_logprobs = J.opt_bool(body, "logprobs", default=False)
    top = J.opt_int(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise errors.invalid_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise errors.invalid_request(
            f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    # max_completion_tokens is the current name; max_tokens the deprecated one
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    params = _sampling(body, max_tokens=J.opt_int(body, param), max_tokens_param=param,
                       logprobs=(top or 0) if want_logprobs else None)
    tools, structured = parse_tools(body), parse_structured(body)
    forced = tools.constraint() if tools is not None else None  # required / a named function
    if forced is not None and structured is not None:
        raise errors.invalid_request(f"'tool_choice' {tools.choice} is generated under the function's schema; "
                                     f"it cannot be combined with '{structured.param}'", "tool_choice")
    params = replace(params, structured=forced or structured)
    stream, include_usage = _stream(body)
    req = ChatRequest(model, messages, params, stream, include_usage, J.opt_str(body, "user"), ignored, tools,
                      _template_kwargs(body.get("chat_template_kwargs")))
    req.continuous_usage = _continuous_usage(body, include_usage)
    req.reasoning_effort = J.opt_str(body, "reasoning_effort")
    return req


def _template_kwargs(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.wrong_type("chat_template_kwargs", 'an object such as {"enable_thinking": false}', value)
    reserved = sorted(set(value) & {"messages", "tools", "documents", "add_generation_prompt"})
    if reserved:
        raise errors.invalid_request(f"'chat_template_kwargs' may not set {', '.join(reserved)}",
                                     "chat_template_kwargs", "invalid_value")
    return value


def check_prompt_length(n_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                        param: str = "prompt") -> int:
    """Reject prompts that do not fit the context (core/context.py, the engine's rule too);
    returns the effective max_tokens (the rest of the context when the client gave none)."""
    try:
        return completion_budget(n_prompt_tokens, max_tokens, max_model_len, param)
    except ContextLengthError as exc:
        raise errors.context_length_exceeded(str(exc), exc.param) from None


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Token-id prompts must name tokens the model has."""
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise errors.invalid_request(
            f"prompt token id {bad} is out of range: the vocabulary has {vocab_size} tokens",
            "prompt", "invalid_value")


# ---- pieces ------------------------------------------------------------------------------
def model_field(body: dict, served: Collection[str] | None) -> str:
    """The request's `model`: present, a string, and served (Responses requests check it the same way)."""
    model = body.get("model")
    if model is None:
        raise errors.missing_parameter("model")
    if not isinstance(model, str):
        raise errors.wrong_type("model", "a string", model)
    if served is not None and model not in served:
        raise errors.model_not_found(model, sorted(served))
    return model


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    prompt = body.get("prompt")
    if prompt is None:
        raise errors.missing_parameter("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one: ["text"] or [[1, 2, 3]]
    if isinstance(prompt, str):
        if not prompt:
            raise errors.invalid_request("'prompt' must not be empty", "prompt", "invalid_value")
        return prompt, None
    if isinstance(prompt, list):
        if not prompt:
            raise errors.invalid_request("'prompt' must not be empty", "prompt", "invalid_value")
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            return None, list(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise errors.unsupported("prompt", f"a batch of {len(prompt)} prompts; send one "
                                     "prompt per request (or use n for several completions)")
    raise errors.wrong_type("prompt", "a string, an array of token ids (non-negative integers) "
                            "or an array holding one of those", prompt)


def _sampling(body: dict, max_tokens: int | None, max_tokens_param: str,
              logprobs: int | None) -> SamplingParams:
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str | list):
        raise errors.wrong_type("stop", "a string or an array of strings", stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise errors.wrong_type("stop_token_ids", "an array of token ids", stop_ids)
    try:
        return SamplingParams(
            n=J.opt_int(body, "n", default=1),
            temperature=J.opt_number(body, "temperature", default=1.0),
            top_p=J.opt_number(body, "top_p", default=1.0),
            top_k=J.opt_int(body, "top_k", default=-1),
            min_p=J.opt_number(body, "min_p", default=0.0),
            seed=J.opt_int(body, "seed"),
            max_tokens=max_tokens,
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            stop_token_ids=list(stop_ids or []),
            ignore_eos=J.opt_bool(body, "ignore_eos", default=False),
            logprobs=logprobs,
            skip_special_tokens=J.opt_bool(body, "skip_special_tokens", default=True),
            presence_penalty=J.opt_number(body, "presence_penalty", default=0.0),
            frequency_penalty=J.opt_number(body, "frequency_penalty", default=0.0),
            repetition_penalty=J.opt_number(body, "repetition_penalty", default=1.0),
            logit_bias=_logit_bias(body.get("logit_bias")),
            min_tokens=J.opt_int(body, "min_tokens", default=0),
        )
    except InvalidSamplingParams as exc:
        param = max_tokens_param if exc.param == "max_tokens" else exc.param
        message = n_limit_message(body.get("n")) if param == "n" else str(exc).replace("max_tokens", param, 1)
        raise errors.invalid_request(message, param, "invalid_value") from None


def _logit_bias(value) -> dict[int, float]:
    """OpenAI's {"token id as a string": bias}; the numbers are checked by SamplingParams."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise errors.wrong_type("logit_bias", 'an object mapping token ids to biases, e.g. {"50256": -100}', value)
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise errors.invalid_request(f"'logit_bias' keys must be token ids (digits), got {key!r}", "logit_bias",
                                         "invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise errors.wrong_type(f"logit_bias[{key!r}]", "a number in [-100, 100]", bias)
        out[int(key)] = float(bias)
    return out


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    bad = next((t for t in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise errors.invalid_request(f"logit_bias token id {bad} is out of range: the vocabulary has {vocab_size} "
                                     "tokens", "logit_bias", "invalid_value")


def _continuous_usage(body: dict, include_usage: bool) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage so far in every chunk (with
    include_usage, as vLLM requires)."""
    value = (body.get("stream_options") or {}).get("continuous_usage_stats", False)
    if not isinstance(value, bool):
        raise errors.wrong_type("stream_options.continuous_usage_stats", "a boolean", value)
    return value and include_usage


def _stream(body: dict) -> tuple[bool, bool]:
    stream = J.opt_bool(body, "stream", default=False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise errors.wrong_type("stream_options", "an object", options)
    if not stream:
        raise errors.invalid_request("'stream_options' is only allowed when 'stream' is true",
                                     "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise errors.wrong_type("stream_options.include_usage", "a boolean", include)
    return stream, include
