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

    prefill locally when the decode worker would finish this prompt before the prefill
    worker could even start it: decode backlog + this prompt <= prefill backlog,

both in prompt tokens still to compute (load reports, plus what this router sent each
worker since its last report), assuming a prefill worker and a decode worker compute
prompt tokens at about the same rate. A prefill pool that keeps up never has such a
backlog, so the decode workers stay free of prefills; `--strict-disaggregation` turns the
rule off for deployments that would rather wait than let a prefill touch a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlacementInputs:
    """Prompt tokens still to compute, as the router knows them."""

    uncached_tokens: int  # this prompt's tokens the chosen decode worker would compute
    decode_backlog: int  # prompt tokens queued on the decode worker (its local prefills)
    prefill_backlog: int  # prompt tokens queued on the chosen prefill worker


def prefill_locally(inputs: PlacementInputs, strict: bool = False) -> str | None:
    """Why the decode worker should prefill this prompt itself although a prefill worker
    could; None to send it to the prefill worker."""
    if strict:
        return None
    finish_locally = inputs.decode_backlog + inputs.uncached_tokens
    if finish_locally <= inputs.prefill_backlog:
        return (f"local: the prefill worker has {inputs.prefill_backlog} prompt tokens queued; the decode worker "
                f"finishes these {inputs.uncached_tokens} (after its {inputs.decode_backlog} queued) first")
    return None
