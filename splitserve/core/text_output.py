"""Token ids -> client text, at the router: incremental detokenization, stop strings
(excluded from the text), and holding back text that could still start a stop string.

The router keeps every token of a choice, so the text stays seamless when a request
migrates to another decode worker mid-stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.core.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    stopped: bool  # a stop string matched: the choice is finished with reason "stop"


@dataclass
class TextAssembler:
    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters handed out
        self.cut: int | None = None  # stop-string position
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        full = self.detok.text
        return full if self.cut is None else full[: self.cut]

    def add(self, token_ids: list[int], final: bool = False) -> TextDelta:
        for t in token_ids:
            self.token_ids.append(t)
            self.detok.add(t)
            if self.stop and self._find_stop():
                return self._delta(token_ids, stopped=True)
        if final:
            self.detok.flush()
            if self.stop and self._find_stop():
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
