"""`POST /v1/responses` request bodies → a `ResponsesRequest`, which becomes a chat request.

The Responses API is served through the chat path (protocol.parse_chat_request, the chat
template or harmony, ChatOutput): this module only translates. The rule for fields is the
router's (request_fields.py), with one table here: every field of OpenAI's schema is
HONOURED, ACCEPTED (no effect on the output) or REFUSED with 400 `unsupported_parameter`
when its value asks for something; unknown fields are ignored and named in the response
header `X-Splitserve-Ignored-Fields`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from splitserve.router import errors, protocol
from splitserve.router import json_body as J
from splitserve.router.request_fields import ACCEPTED, HONOURED, REFUSED
from splitserve.router.responses_items import as_items, to_messages


def _on(v) -> bool:  # present and not empty, false or zero
    return v not in (None, False, 0, "", [], {})


# Refused fields: field -> (does its value ask for something?, why)
_REFUSED = {
    "background": (_on, "background responses are not served; send the request and wait, or stream it"),
    "background_options": (_on, "background responses are not served"),
    "conversation": (_on, "conversations are OpenAI platform objects; use previous_response_id"),
    "context_management": (_on, "server-side context compaction is not implemented"),
    "include": (_on, "none of the extra output data (logprobs, encrypted reasoning, tool results) is served"),
    "moderation": (_on, "moderation is not available"),
    "prompt": (_on, "prompt templates are OpenAI platform objects; send input and instructions"),
    "top_logprobs": (_on, "logprobs are not served on /v1/responses; use /v1/chat/completions"),
    "truncation": (lambda v: v not in (None, "disabled"), "a conversation longer than the context is refused "
                                                          "(400 context_length_exceeded), never truncated"),
    "image": (_on, "image generation is not available"),
    "access_programs": (_on, "not available"),
}
FIELDS = {
    **{name: HONOURED for name in ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                                   "tools", "tool_choice", "parallel_tool_calls", "previous_response_id", "store",
                                   "stream", "text", "reasoning", "metadata")},
    **{name: ACCEPTED for name in ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
                                   "prompt_cache_retention", "service_tier", "stream_options",
                                   "max_tool_calls")},  # a cap on built-in tool calls: none are served
    **{name: REFUSED for name in _REFUSED},
}
REASONING_KEYS = ("effort", "summary", "generate_summary", "context", "mode")
# a chat-path error's parameter, as the Responses request names it
RENAMED = {"max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort", "messages": "input"}


@dataclass
class ResponsesRequest:
    model: str
    items: list[dict]  # this request's input items (a string input is one user message)
    chat_fields: dict  # the chat request's fields other than model and messages
    echo: dict  # the request's settings, as the Response object repeats them
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    ignored_fields: list[str] = field(default_factory=list)

    def chat_body(self, history: list[dict], developer_role: str = "system") -> dict:
        """The chat request: instructions first (the previous response's are not carried
        over, as OpenAI does), then the stored conversation, then this input."""
        messages = [{"role": developer_role, "content": self.instructions}] if self.instructions else []
        messages += to_messages(history + self.items, developer_role)
        return {"model": self.model, "messages": messages, **self.chat_fields}


def parse_responses_request(raw, served_models: Collection[str] | None = None) -> ResponsesRequest:
    body = J.load(raw)
    model = protocol.model_field(body, served_models)
    if "input" not in body:
        raise errors.missing_parameter("input")
    items = as_items(body["input"])
    for name, (used, why) in _REFUSED.items():
        if name in body and used(body[name]):
            raise errors.unsupported(name, why)
    chat: dict = {}
    for name, chat_name in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                            ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice["name"]}}
    text = _text(body.get("text"))
    if text["format"]["type"] != "text":
        chat["response_format"] = _response_format(text["format"])
    reasoning = _reasoning(body.get("reasoning"))
    if reasoning["effort"] is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    stream = J.opt_bool(body, "stream", default=False)
    chat["stream"] = stream
    instructions = J.opt_str(body, "instructions")
    previous = J.opt_str(body, "previous_response_id")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": _metadata(body.get("metadata")), "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "reasoning": reasoning, "temperature": body.get("temperature", 1.0),
            "text": text, "tool_choice": choice or "auto", "tools": tools, "top_p": body.get("top_p", 1.0),
            "truncation": "disabled", "user": J.opt_str(body, "user"),
            "service_tier": J.opt_str(body, "service_tier") or "default"}
    ignored = sorted(k for k in body if k not in FIELDS)
    return ResponsesRequest(model, items, chat, echo, instructions, previous,
                            J.opt_bool(body, "store", default=True), stream, ignored)


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise errors.wrong_type("tools", "an array of tools", value)
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise errors.wrong_type(f"tools[{i}]", 'a function tool {"type": "function", "name": ...}', tool)
        if tool.get("type") != "function":
            raise errors.unsupported(f"tools[{i}].type", f"tools of type {tool.get('type')!r}: built-in tools are "
                                     "not available; only function tools are served")
    return value


def _tool_choice(value) -> str | dict | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        if not isinstance(value.get("name"), str):
            raise errors.wrong_type("tool_choice.name", "a string", value.get("name"))
        return value
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        raise errors.unsupported("tool_choice", f"tool_choice of type {value['type']!r}; only none, auto, required "
                                 'and {"type": "function", "name": ...} are served')
    raise errors.wrong_type("tool_choice", 'none, auto, required or {"type": "function", "name": ...}', value)


def _text(value) -> dict:
    if value is None:
        return {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise errors.wrong_type("text", 'an object such as {"format": {"type": "text"}}', value)
    if value.get("verbosity") is not None:
        raise errors.unsupported("text.verbosity", "not implemented")
    fmt = value.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise errors.invalid_request("'text.format.type' must be text, json_object or json_schema", "text.format.type",
                                     "invalid_value")
    return {"format": fmt}


def _response_format(fmt: dict) -> dict:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


def _reasoning(value) -> dict:
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise errors.wrong_type("reasoning", 'an object such as {"effort": "low"}', value)
    for key in REASONING_KEYS[1:]:
        if value.get(key) is not None:
            raise errors.unsupported(f"reasoning.{key}", "reasoning summaries are not generated; the reasoning "
                                     "itself comes back as a reasoning item's reasoning_text"
                                     if "summary" in key else "not implemented")
    effort = value.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise errors.wrong_type("reasoning.effort", "a string (low, medium or high)", effort)
    return {"effort": effort, "summary": None}


def _metadata(value) -> dict:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16:
        raise errors.wrong_type("metadata", "an object of at most 16 string pairs", value)
    for key, v in value.items():
        if not isinstance(v, str) or len(key) > 64 or len(v) > 512:
            raise errors.invalid_request("'metadata' keys are strings of up to 64 characters and values strings of "
                                         "up to 512", "metadata", "invalid_value")
    return value


def renamed(exc: errors.APIError) -> errors.APIError:
    """A chat-path error about a field, named as the Responses request names it."""
    param = exc.param or ""
    head = param.split("[")[0].split(".")[0]
    if head == "response_format":  # chat's response_format.json_schema.X is text.format.X
        new = "text.format" + param[len(head):].replace(".json_schema", "", 1)
    elif head in RENAMED:
        new = RENAMED[head] if head == "messages" else RENAMED[head] + param[len(head):]
    elif head in ("tools", "tool_choice"):  # chat's {"function": {"name"}} is flat here
        new = param.replace(".function.", ".")
    else:
        return exc
    if head == "messages":  # a common word: only where quoted, or the context-length error's
        message = exc.message.replace(f"'{param}'", f"'{new}'").replace(f"'{head}'", f"'{new}'")
        message = message.replace("the messages has", "the input has").replace("Shorten the messages", "Shorten "
                                                                                "the input")
    else:
        message = exc.message.replace(param, new)
    if head == "reasoning_effort" and exc.code == "unsupported_parameter":  # the chat path's hint is chat's
        message = ("'reasoning.effort' is not supported for this model: its chat template takes no reasoning effort "
                   "(harmony models such as gpt-oss do)")
    return errors.APIError(exc.status, message, exc.type, new, exc.code)


def markdown_table() -> str:
    """docs/api.md's list for /v1/responses (tests keep the two equal)."""
    out = ["#### POST /v1/responses", "", "| field | |", "|---|---|"]
    out += [f"| `{name}` | {kind}{': ' + _REFUSED[name][1] if kind == REFUSED else ''} |"
            for name, kind in sorted(FIELDS.items())]
    return "\n".join(out)
