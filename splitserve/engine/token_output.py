"""Where a sampled token goes: it joins its sequence, advances the grammar and the text,
meets the stop checks (the sequence may finish with it) and becomes a RequestOutput.

One object, called by its public names from every place that produces tokens: the
engine's ordinary step (`append`), speculative verification (`append_run`: several tokens
as one output, engine/spec/step.py), disaggregation (the first token a prefill worker
sampled, engine/disaggregation.py) and the overlapped step (`took`: the token replaced a
placeholder already in `token_ids`, engine/overlap.py). `output` builds the RequestOutput
alone (a failed request's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.core.logprobs import TokenLogprobs
from splitserve.engine.grammar import advance
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from splitserve.engine.scheduler import Scheduler


class TokenOutput:
    def __init__(self, scheduler: Scheduler, sequences: dict[str, Sequence], held: dict[str, Sequence],
                 eos_token_ids: set[int], long_rope_after: int | None, delta_outputs: bool):
        self.scheduler = scheduler
        self.sequences = sequences  # the engine's live requests: a finished one leaves
        self.held = held  # the engine's finished requests whose KV is kept for a push
        self.eos_token_ids = eos_token_ids
        self.long_rope_after = long_rope_after
        self.delta_outputs = delta_outputs  # outputs carry this step's part only (EngineConfig)

    def append(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        """A sampled token joins `seq`, which may finish with it."""
        seq.token_ids.append(token)
        return self.took(seq, token, lp)

    def took(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        """`token`, now the last of `seq.token_ids`: its logprobs, grammar, text, stop checks."""
        if lp is not None:
            seq.logprobs.append(lp)
        if seq.grammar is not None:
            advance(seq.grammar, token, seq.request_id)
        delta = seq.text.add([token]) if seq.text is not None else None
        new_text = delta.text if delta is not None else ""
        num_output = len(seq.token_ids) - seq.num_prompt_tokens  # (read once: this runs per token)
        reason = self._stop_reason(seq, token, delta is not None and delta.stopped, num_output)
        if reason is not None:
            if seq.text is not None and not seq.text.stopped:
                final = seq.text.add([], final=True)  # the rest, an incomplete character too
                new_text += final.text
                reason = "stop" if final.stopped else reason
            self._finish(seq, reason)
        elif self.long_rope_after is not None and not seq.long_rope and seq.num_tokens > self.long_rope_after:
            self.scheduler.recompute_with_long_rope(seq)
        times = seq.first_token_times() if num_output == 1 else None
        return self.output(seq, [token], [lp] if lp is not None else [], new_text, times)

    def append_run(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """Several tokens join `seq` as one output (verified drafts); the first that ends it
        is the last taken."""
        taken: list[int] = []
        text = ""
        for token, lp in zip(tokens, logprobs, strict=True):
            out = self.append(seq, token, lp)
            taken.append(token)
            text += out.new_text
            if seq.status != SequenceStatus.RUNNING:  # finished, or back to the queue (longrope)
                break
        new_lps = [lp for lp in logprobs[: len(taken)] if lp is not None]
        return self.output(seq, taken, new_lps, text)

    def output(self, seq: Sequence, new_tokens: list[int], new_lps: list[TokenLogprobs],
               new_text: str = "", times: dict | None = None) -> RequestOutput:
        """`seq`'s RequestOutput with this step's part (cumulative fields too unless delta_outputs)."""
        if self.delta_outputs:  # the cumulative fields left empty (EngineConfig.delta_outputs)
            return RequestOutput(seq.request_id, [], [], new_tokens, "", new_text, seq.is_finished,
                                 seq.finish_reason, max(seq.num_cached_tokens, 0), [], new_lps, **(times or {}))
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids, new_token_ids=new_tokens,
            text=seq.text.visible_text if seq.text is not None else "", new_text=new_text, finished=seq.is_finished,
            finish_reason=seq.finish_reason, num_cached_tokens=max(seq.num_cached_tokens, 0),
            logprobs=list(seq.logprobs), new_logprobs=new_lps, **(times or {}))

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason, free_blocks=not seq.hold_kv)
        self.sequences.pop(seq.request_id, None)
        if seq.hold_kv:
            self.held[seq.request_id] = seq

    def _stop_reason(self, seq: Sequence, token: int, stop_string: bool, num_output: int) -> str | None:
        p = seq.params
        if seq.grammar is not None and seq.grammar.is_stopped():  # complete: nothing more may follow
            return "abort" if seq.grammar.is_error() else "stop"
        if num_output < p.min_tokens:  # (EOS and stop ids were masked in sampling)
            stop_string = False
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids or stop_string:
            return "stop"
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return "length"
        if num_output + seq.num_prompt_tokens >= seq.max_total_tokens:
            return "length"
        return None
