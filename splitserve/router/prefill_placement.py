"""Where a prompt's prefill runs when a prefill worker could take it: remotely, or on the
decode worker itself because the prefill pool is backed up (conditional disaggregation).

Disaggregation keeps long prefills off the decode workers so their streams keep a steady
inter-token latency. But when the prefill pool is saturated, a prompt sent there waits
behind the whole backlog while the decode worker, which could have computed it, sits
mostly idle: on a 2-core machine serving SmolLM2 at concurrency 8, one prefill and one
decode worker gave a mean time to first token of 9.2 s against 3.9 s for a lone decode
worker prefilling everything itself (docs/benchmarks.md, issue 30), at the same tokens
per second: the prefill worker was the bottleneck and the decode core idled.
NVIDIA Dynamo makes the same call (its conditional disaggregation prefills locally when the
prefill queue is too long); here the rule is relative, so it holds on any hardware:

    prefill locally when the decode worker's prompt backlog is shorter than the prefill
    worker's (join the shorter queue; a tie goes to the prefill worker),

both in prompt tokens still to compute (load reports, plus what this router sent each
worker since its last report), assuming a prefill worker and a decode worker compute
prompt tokens at about the same rate: the prompt then finishes where it finishes first.
A more cautious first version prefilled locally only when the decode worker would finish
the prompt before the prefill worker could start it (backlog + prompt <= prefill backlog);
measured on SmolLM2 at concurrency 8, 1 prefill + 1 decode worker, against vLLM's CPU
backend in the same run: 47 tok/s and a mean TTFT of 4,953 ms (vLLM 36, 3,733 ms); with the
shorter-queue rule 54 tok/s and 3,542 ms (vLLM 37, 3,320 ms). A pool that keeps up never has
a backlog longer than a decode worker's, so decode steps stay free of prefills then;
`--strict-disaggregation` turns the rule off for deployments that would rather wait than let
a prefill touch a decode step.

A tie at zero goes to an *idle* decode worker (no stream runs there, as far as the router
can tell: worker_backlog.py's `idle`): a prefill there slows no one's tokens, and the prompt's KV
need not move. Measured on SmolLM2 at concurrency 1 (one request at a time), 1 prefill + 1
decode worker sending every prompt to the prefill worker had a mean TTFT of 1,129 ms against
1,066 for a lone decode worker and 1,052 for vLLM (docs/benchmarks.md): the transfer and
hand-off. Busy decode workers keep the tie rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementInputs:
    """Prompt tokens still to compute, as the router knows them."""

    uncached_tokens: int  # this prompt's tokens the chosen decode worker would compute
    decode_backlog: int  # prompt tokens queued on the decode worker (its local prefills)
    prefill_backlog: int  # prompt tokens queued on the chosen prefill worker
    decode_idle: bool = False  # no stream runs on the decode worker (worker_backlog.py's idle)


def prefill_locally(inputs: PlacementInputs, strict: bool = False) -> str | None:
    """Why the decode worker should prefill this prompt itself although a prefill worker
    could; None to send it to the prefill worker."""
    if strict:
        return None
    if inputs.decode_idle and inputs.decode_backlog == 0:
        return (f"local: the decode worker is idle: its {inputs.uncached_tokens} prompt tokens slow no stream there "
                "and their KV need not move")
    if inputs.decode_backlog < inputs.prefill_backlog:
        return (f"local: the prefill worker has {inputs.prefill_backlog} prompt tokens queued, the decode worker "
                f"{inputs.decode_backlog}: these {inputs.uncached_tokens} finish sooner there")
    return None
