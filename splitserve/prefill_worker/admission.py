"""Whether a prefill worker takes a prompt, from its own measured prefill rate.

The decode worker gives every remote prefill a deadline (PrefillRequest.timeout_s, its
`--prefill-timeout`). A prompt that joins a queue the prefill worker cannot clear in time
is computed twice: here until the deadline passes, then again locally on the decode worker
(issue 38: a burst of 24 long prompts timed out 43 of 48 remote prefills). So the worker
refuses at once the prompts it expects to miss: the prompt tokens it has admitted and not
finished, plus this prompt, over its measured throughput, against the deadline less a
share kept for the KV push. Refused (RESOURCE_EXHAUSTED), the decode worker prefills
locally straight away: nothing is computed twice, and the first token comes sooner than
after a timeout.

Throughput is measured while busy: prompt tokens of finished prefills over the seconds in
which at least one prefill was outstanding, averaged over recent windows, so batching
counts and idle time does not. Before its first measurement a worker admits one step's
budget of prompt tokens (`blind_tokens`; any prompt when nothing is outstanding), which
measures it: admitting everything let a burst in its first seconds time out, refusing all
would never measure. So the first burst after a start is mostly prefilled on the decode
workers (seen in the SmolLM2 compare at concurrency 8: 2 of 3 refused). An idle worker whose measurement is
older than REMEASURE_S admits one prompt whatever it says, so one bad sample cannot refuse
everything for good. Prefix-cache hits make the
estimate pessimistic (their tokens are not computed), which errs towards a local prefill,
never towards a duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass

PUSH_SHARE = 0.2  # of the deadline, kept for the KV push and the reply
MIN_WINDOW_S = 0.1  # seconds of steps a rate sample spans at least (one demo-model prefill: 0.16 s)
REMEASURE_S = 60.0  # an idle worker with an older measurement admits one prompt to measure again


@dataclass
class PrefillThroughput:
    """Outstanding prompt tokens and the measured prompt tokens per busy second."""

    blind_tokens: int = 2048  # admitted before any measurement: one step's budget
    smoothing: float = 0.3  # weight of the newest window
    tokens_per_s: float | None = None
    outstanding_tokens: int = 0
    outstanding: int = 0
    measured_at: float | None = None
    _tokens: int | None = None  # the engine's counters at the start of the current window
    _seconds: float = 0.0

    def started(self, tokens: int) -> None:
        self.outstanding += 1
        self.outstanding_tokens += tokens

    def finished(self, tokens: int) -> None:
        self.outstanding = max(0, self.outstanding - 1)
        self.outstanding_tokens = max(0, self.outstanding_tokens - tokens)

    def observe(self, tokens_computed: int, step_seconds: float, now: float) -> None:
        """The engine's cumulative prompt tokens and step seconds (EngineStats)."""
        if self._tokens is None or tokens_computed < self._tokens:  # first look, or a new engine
            self._tokens, self._seconds = tokens_computed, step_seconds
            return
        busy, done = step_seconds - self._seconds, tokens_computed - self._tokens
        if busy >= MIN_WINDOW_S and done > 0:
            rate = done / busy
            self.tokens_per_s = rate if self.tokens_per_s is None else (
                self.smoothing * rate + (1 - self.smoothing) * self.tokens_per_s)
            self.measured_at = now
            self._tokens, self._seconds = tokens_computed, step_seconds

    def refusal(self, prompt_tokens: int, deadline_s: float, now: float) -> str | None:
        """None to admit a prompt of `prompt_tokens` due within `deadline_s` (0: no
        deadline); otherwise why it would miss, for the caller's log."""
        if deadline_s <= 0:
            return None
        if self.tokens_per_s is None:  # nothing measured yet: one step's worth, which measures it
            if self.outstanding == 0 or self.outstanding_tokens + prompt_tokens <= self.blind_tokens:
                return None
            return (f"{self.outstanding_tokens} prompt tokens are queued and this worker has not measured its "
                    f"prefill rate yet (it admits {self.blind_tokens} tokens until it has)")
        if self.outstanding == 0 and now - self.measured_at > REMEASURE_S:
            return None  # idle, and the measurement is old: this one measures again
        return refusal(self.outstanding_tokens, prompt_tokens, self.tokens_per_s, deadline_s)


def refusal(outstanding_tokens: int, prompt_tokens: int, tokens_per_s: float, deadline_s: float) -> str | None:
    """None when the queue and the prompt fit the deadline less the push's share."""
    if deadline_s <= 0:
        return None
    eta = (outstanding_tokens + prompt_tokens) / tokens_per_s
    budget = deadline_s * (1 - PUSH_SHARE)
    if eta <= budget:
        return None
    return (f"{outstanding_tokens} prompt tokens are queued ahead of these {prompt_tokens} at about "
            f"{tokens_per_s:.0f} tokens/s: about {eta:.1f} s, past the {budget:.1f} s this prefill may take "
            f"within the caller's {deadline_s:g} s deadline")
