"""Token ids -> text: incremental detokenization, stop strings (excluded from the text),
and holding back text that could still become the start of a stop string.

The one implementation of both, used where text is needed: the router builds the text
the client sees (it keeps every token of a choice, so the text stays seamless when a
request migrates to another decode worker mid-stream); the engine runs it to end a
sequence at a stop string (the offline `LLM` also returns its text). A worker serving
the router asks for no text, so its engine detokenizes only requests with stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.core.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    stopped: bool  # a stop string matched: the sequence is finished with reason "stop"


@dataclass
class TextAssembler:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings count only once this many tokens exist (vLLM's min_tokens)

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters handed out
        self.cut: int | None = None  # stop-string position
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        """All text so far, cut at a matched stop string (some of it may be held back)."""
        full = self.detok.text
        return full if self.cut is None else full[: self.cut]

    @property
    def visible_text(self) -> str:
        """The text handed out so far."""
        return self.text[: self.emitted]

    @property
    def stopped(self) -> bool:
        return self.cut is not None

    def add(self, token_ids: list[int], final: bool = False) -> TextDelta:
        """Append tokens; `final` when the sequence ended (for another reason, or this one)."""
        if self.stopped:  # nothing after a stop string is text
            return TextDelta("", token_ids, True)
        for t in token_ids:
            self.token_ids.append(t)
            self.detok.add(t)
            if self.stop and len(self.token_ids) >= self.min_tokens and self._find_stop():
                return self._delta(token_ids, stopped=True)
        if final:
            self.detok.flush()
            if self.stop and len(self.token_ids) >= self.min_tokens and self._find_stop():
                return self._delta(token_ids, stopped=True)
        return self._delta(token_ids, stopped=False, final=final)

    def _find_stop(self) -> bool:
        text = self.detok.text
        start = max(0, self.emitted - self._holdback)
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        if hits:
            self.cut = min(hits)
        return bool(hits)

    def _delta(self, token_ids: list[int], stopped: bool, final: bool = False) -> TextDelta:
        text = self.text
        visible = text if (stopped or final) else text[: max(self.emitted, len(text) - self._holdback)]
        delta = visible[self.emitted :]
        self.emitted = len(visible)
        return TextDelta(delta, token_ids, stopped)
