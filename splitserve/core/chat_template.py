"""Render a checkpoint's chat template as transformers' `apply_chat_template` does: the same
sandbox, filters and variables (messages, tools, documents, add_generation_prompt, the
named special tokens, and the caller's `chat_template_kwargs` such as `enable_thinking`),
so a prompt here is token for token the one the model was trained on
(tests/router/test_chat_template.py compares the two on tool-calling histories).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # one value, under each name templates read


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compiled(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
           special_tokens: dict[str, str] | None = None, template_kwargs: dict | None = None) -> str:
    """The prompt text. `template_kwargs` override the special tokens, as in transformers."""
    variables = {**(special_tokens or {}), **(template_kwargs or {})}
    try:
        return _compiled(template).render(messages=[_with_reasoning_aliases(m) for m in messages], tools=tools,
                                          documents=None, add_generation_prompt=add_generation_prompt,
                                          **variables)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a template tripping over odd input
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
