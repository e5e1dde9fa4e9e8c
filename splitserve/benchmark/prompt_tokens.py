"""Text prompts of an exact number of tokens, counted as the served model counts them.

`--input-len 32` means 32 prompt tokens on either endpoint: for completions the text as
the server tokenizes it (BOS included), for chat the whole prompt after the chat template.
A counter gives that number for a candidate text: the server's own `POST /tokenize`
(vLLM's API; splitserve and vLLM serve it) by default, or a local tokenizer.json with
`--tokenizer DIR`. `PromptFitter` then takes the longest run of the drawn words whose
prompt is at most the target (a binary search: a word adds at least one token) and, when
the next word would overshoot, pads with one-token filler words to hit it exactly.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable

Counter = Callable[[str], float]  # text -> prompt tokens; math.inf when longer than the context
FILLERS = ("a", "I", "x", "o", "s", "e", "t", "n")  # one token each in most vocabularies


class PromptSizeError(RuntimeError):
    """No prompt of the asked size can be made, or the tokenizer could not be reached."""


def server_counter(base_url: str, model: str, chat: bool, api_key: str | None = None,
                   timeout_s: float = 60.0) -> Counter:
    """The server's `POST /tokenize`: a completion's text, or a chat of one user message."""
    url = base_url.rstrip("/") + "/tokenize"
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def count(text: str) -> float:
        body = ({"model": model, "messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
                if chat else {"model": model, "prompt": text})
        request = urllib.request.Request(url, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                return json.load(resp)["count"]
        except urllib.error.HTTPError as exc:
            error = _error_of(exc)
            if exc.code == 400 and error.get("code") == "context_length_exceeded":
                return math.inf  # a probe longer than the context: too long, whatever its count
            raise PromptSizeError(
                f"text prompts are sized with the served model's tokenizer, but {url} answered {exc.code}"
                f"{': ' + error['message'] if error.get('message') else ''}. Pass --tokenizer DIR (a directory "
                "with the model's tokenizer.json) or use --prompt-format ids") from None
        except (OSError, ValueError, KeyError) as exc:
            raise PromptSizeError(f"could not count prompt tokens at {url}: {exc}. Pass --tokenizer DIR "
                                  "(a directory with the model's tokenizer.json) or use --prompt-format ids") from None

    return count


def local_counter(tokenizer_dir: str, chat: bool) -> Counter:
    """A checkpoint's tokenizer.json and chat template, counted as splitserve's router does."""
    from splitserve.core.model_config import CheckpointError
    from splitserve.core.tokenizer import ChatTemplateError, Tokenizer

    try:
        tokenizer = Tokenizer(tokenizer_dir)
    except CheckpointError as exc:
        raise PromptSizeError(f"--tokenizer {tokenizer_dir}: {exc}") from None
    if not chat:
        return lambda text: len(tokenizer.encode(text))

    def count(text: str) -> float:
        try:
            return len(tokenizer.encode_chat([{"role": "user", "content": text}]))
        except ChatTemplateError as exc:
            raise PromptSizeError(f"--tokenizer {tokenizer_dir}: {exc}") from None

    return count


class PromptFitter:
    def __init__(self, count: Counter):
        self._count = count
        self._cache: dict[str, float] = {}

    def count(self, text: str) -> float:
        if text not in self._cache:
            self._cache[text] = self._count(text)
        return self._cache[text]

    def fit(self, words: list[str], target: int, head: str = "") -> str:
        """`head` (a shared prefix, or nothing) followed by leading `words` and perhaps
        fillers, whose prompt is exactly `target` tokens. Give at least `target` words."""

        def text(k: int) -> str:
            return " ".join(([head] if head else []) + words[:k])

        lo, hi = (0 if head else 1), len(words)  # without a head, at least one word: no empty prompts
        if self.count(text(lo)) > target:
            raise PromptSizeError(
                f"a prompt of {target} tokens cannot be made: {self.count(text(lo))} tokens already with "
                f"{'the shared prefix' if head else 'one word'} (chat template and BOS included); "
                "ask for a longer --input-len")
        # c(lo) <= target: find the largest such k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(text(mid)) <= target:
                lo = mid
            else:
                hi = mid - 1
        best = text(lo)
        gap = target - self.count(best)
        if gap == 0:
            return best
        for filler in FILLERS:
            candidate = best + f" {filler}" * int(gap)
            if self.count(candidate) == target:
                return candidate
        raise PromptSizeError(f"no text of exactly {target} tokens found: {int(target - gap)} tokens with "
                              f"{lo} words, and no one-token filler word ({', '.join(FILLERS)}) closes the gap "
                              f"of {int(gap)}; use --prompt-format ids")


def _error_of(exc: urllib.error.HTTPError) -> dict:
    try:
        error = json.loads(exc.read()).get("error")
    except (ValueError, AttributeError, OSError):
        return {}
    return error if isinstance(error, dict) else {}
