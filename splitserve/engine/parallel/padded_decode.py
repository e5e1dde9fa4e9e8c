"""The overlapped decode step (engine/overlap.py) over tensor-parallel ranks.

Rank 0 launches a pure-decode step before the previous step's tokens reach its host: the
step's inputs hold placeholders -(j + 1), "row j of the tokens the previous step sampled",
which the padded step (cuda_graphs.DecodeGraphs, run eagerly under TP) reads from
`previous_tokens` on the device. Ranks 1..N-1 run the same padded step on their slices, so
they get the same staged inputs (a host broadcast of the flat buffer, with the step's LoRA
plan) and rank 0's `previous_tokens` (a device broadcast: on CUDA ordered on the stream
behind the sampling, so nobody waits for it on the host). The ranks then compute the same
rows with the same collectives; their copy of the logits is dropped, as in every step.

Ordinary steps under TP take the generic eager path (ModelRunner.run broadcasts their
StepInputs), never the padded one: only an overlapped step is broadcast from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.parallel.state import broadcast_object, broadcast_tensor


@dataclass
class PaddedDecodeStep:
    """What ranks 1..N-1 need of an overlapped decode step."""

    flat: torch.Tensor  # the bucket's staged inputs (CPU int64; placeholders included)
    bucket: int
    lora: object | None  # the step's LoRAStepPlan (lora/ranks.py), None without LoRA


def send_padded_step(graphs, bucket: int, lora_plan) -> None:
    """Rank 0, after `graphs.stage`: the step's inputs, then the previous step's tokens."""
    flat = graphs.staging.host(bucket)[: graphs.staging.size(bucket)].clone()
    broadcast_object(PaddedDecodeStep(flat, bucket, lora_plan))
    broadcast_tensor(graphs.previous_tokens)


def run_padded_step(runner, step: PaddedDecodeStep, lora) -> None:
    """Ranks 1..N-1: the same padded step as rank 0, on this rank's slices."""
    graphs = runner.decode_graphs
    if lora is not None:  # the step's adapters in their slots, as rank 0 put them
        lora.apply(step.lora)
    graphs.stage_flat(step.flat, step.bucket)
    broadcast_tensor(graphs.previous_tokens)
    with torch.inference_mode():
        graphs.execute(step.bucket)
