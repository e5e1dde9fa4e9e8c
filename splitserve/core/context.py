"""Does a request fit the context? One rule for the router (400 context_length_exceeded)
and the engine (offline `LLM.generate` and the workers), so neither truncates silently."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit; `param` names the culprit."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def completion_budget(n_prompt_tokens: int, max_tokens: int | None, limit: int, param: str = "prompt",
                      what: str = "This model's maximum context length") -> int:
    """The number of tokens the completion may have: `max_tokens`, or the rest of the
    context when None. Raises ContextLengthError when the request does not fit `limit`."""
    if n_prompt_tokens >= limit:
        raise ContextLengthError(
            f"{what} is {limit} tokens, but the prompt has {n_prompt_tokens} tokens (at least one token "
            "must be left to generate). Shorten the prompt.", param)
    if max_tokens is None:
        return limit - n_prompt_tokens
    if n_prompt_tokens + max_tokens > limit:
        raise ContextLengthError(
            f"{what} is {limit} tokens, but you requested {n_prompt_tokens + max_tokens} tokens "
            f"({n_prompt_tokens} in the prompt, {max_tokens} for the completion). Reduce the prompt or "
            f"max_tokens (at most {limit - n_prompt_tokens} here).", "max_tokens")
    return max_tokens
