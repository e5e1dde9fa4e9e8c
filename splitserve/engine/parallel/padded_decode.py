"""The padded decode step (engine/cuda_graphs.py) over tensor-parallel ranks.

Rank 0 stages a pure-decode step into its bucket's static input; ranks 1..N-1 run the same
padded step on their slices, so they get the same staged inputs (a host broadcast of the
flat buffer, LoRA adapter slots included, with the step's LoRA plan: which adapter each slot
must hold) and copy them into their own static buffer, then replay their own graph of that
bucket (or run it eagerly: capture=False, the CPU path). The ranks compute the same rows
with the same collectives; their copy of the logits is dropped, as in every step.

The overlapped decode (engine/overlap.py) launches such a step before the previous step's
tokens reach the host: its inputs hold placeholders -(j + 1), "row j of the tokens the
previous step sampled", read from `previous_tokens` on the device, so with async scheduling
rank 0's `previous_tokens` follow (a device broadcast: on CUDA ordered on the stream behind
the sampling, so nobody waits for it on the host).

Rank 0's executor sends both kinds of step (engine/executor.py, TensorParallelExecutor):
this message for a padded decode step, the StepInputs for the others (prefills, oversized
batches), which take the generic eager path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.parallel.state import broadcast_object, broadcast_tensor


@dataclass
class PaddedDecodeStep:
    """What ranks 1..N-1 need of a padded decode step."""

    flat: torch.Tensor  # the bucket's staged inputs (CPU int64; placeholders included)
    bucket: int
    lora: object | None  # the step's LoRAStepPlan (lora/ranks.py), None without LoRA


def send_padded_step(graphs, bucket: int, lora_plan) -> None:
    """Rank 0, after `graphs.stage`: the step's inputs, then (async scheduling) the previous
    step's tokens."""
    flat = graphs.staging.host(bucket)[: graphs.staging.size(bucket)].clone()
    broadcast_object(PaddedDecodeStep(flat, bucket, lora_plan))
    if graphs.previous_tokens is not None:
        broadcast_tensor(graphs.previous_tokens)


def run_padded_step(runner, step: PaddedDecodeStep, lora) -> None:
    """Ranks 1..N-1: the same padded step as rank 0, on this rank's slices. A rank whose
    runner has no padded step yet builds it eagerly: rank 0 turned it on after the start
    (ModelRunner.enable_decode_graphs(capture=False), the CPU tests' way); captured graphs
    are made at every rank's start alike (EngineConfig.use_cuda_graphs)."""
    if runner.decode_graphs is None:
        runner.enable_decode_graphs(capture=False)
    graphs = runner.decode_graphs
    if lora is not None:  # the step's adapters in their slots, as rank 0 put them
        lora.apply(step.lora)
    graphs.stage_flat(step.flat, step.bucket)
    if graphs.previous_tokens is not None:  # the same config as rank 0's: it sent them
        broadcast_tensor(graphs.previous_tokens)
    with torch.inference_mode():
        graphs.execute(step.bucket)
