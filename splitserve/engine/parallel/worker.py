"""Ranks 1..N-1 of a tensor-parallel engine: each a process that loads its slice of the
model and its slice of the KV pool, then runs every step rank 0 broadcasts, until rank 0
broadcasts None. Rank 0 schedules and samples; these ranks only compute (their copy of
the gathered logits is dropped). With LoRA on, a rank also loads the adapters rank 0
loads (all ranks or none) and puts each step's adapters in the slots rank 0 chose
(lora/ranks.py). A pure-decode step comes as a PaddedDecodeStep: the rank replays its own
CUDA graph of that bucket (captured at its start) or runs the padded step eagerly
(parallel/padded_decode.py). Asked once (SHARE_KV_POOL), a rank hands rank 0 its KV
pool tensor in shared memory, for the worker's KV transfer (parallel/kv_shards.py).
A thread of each rank writes the time into its slot of `beats` every BEAT_INTERVAL_S, so
rank 0 sees a rank frozen (SIGSTOP) or starved, which no collective reports (group.silence)."""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers the shared-memory pickling of tensors

from splitserve.engine.config import EngineConfig
from splitserve.engine.parallel.padded_decode import PaddedDecodeStep, run_padded_step
from splitserve.engine.parallel.state import (
    NO_TIMEOUT,
    RankLost,
    broadcast_object,
    destroy_tensor_parallel,
    init_tensor_parallel,
)

SHARE_KV_POOL = "share-kv-pool"  # broadcast instead of a step: send your pool tensor to rank 0
BEAT_INTERVAL_S = 0.25  # how often a rank process says it runs (a shared monotonic timestamp)


def beat(beats, rank: int) -> None:
    """This process's heartbeat, on a thread of its own: stopped with it (SIGSTOP stops every
    thread), late when it is starved; whatever its main thread does (a step, a collective)."""
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        time.sleep(BEAT_INTERVAL_S)


def shared(pool: torch.Tensor) -> torch.Tensor:
    """The pool tensor, moved into shared memory in place on the CPU (the runner's views
    follow it); a CUDA tensor crosses processes as a CUDA IPC handle as it is."""
    return pool.share_memory_()


def rank_config(cfg: EngineConfig, rank: int) -> EngineConfig:
    """One device per rank on CUDA (cuda:rank); the CPU is shared, its cores split evenly."""
    if torch.device(cfg.device).type == "cuda":
        return replace(cfg, device=f"cuda:{rank}")
    return cfg


def cpu_threads(size: int) -> int:
    """Each rank's share of the CPUs this process may run on (serve pins each engine)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // size)


def loaded(error: str | None) -> str | None:
    """Every rank says whether it loaded; the first rank's error, if any (all ranks call it)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def rank_lora(runner, cfg: EngineConfig):
    """This rank's LoRA slots and adapters (lora/ranks.py), None unless enable_lora."""
    if not cfg.enable_lora:
        return None
    from splitserve.engine.lora.ranks import RankLoRA

    return RankLoRA(runner.model, cfg.max_loras, cfg.max_lora_rank, cfg.torch_dtype, runner.device)


def run_rank(rank: int, size: int, port: int, cfg: EngineConfig, max_model_len: int, to_rank0, beats) -> None:
    from splitserve.core.model_config import ModelConfig
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.step_inputs import StepInputs

    threading.Thread(target=beat, args=(beats, rank), name="tp-rank-beat", daemon=True).start()
    cfg = rank_config(cfg, rank)
    if torch.device(cfg.device).type == "cuda":
        torch.cuda.set_device(cfg.device)
    else:
        torch.set_num_threads(cpu_threads(size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=NO_TIMEOUT)
    store.set(f"joined{rank}", "1")  # rank 0 waits for these, watching that this process lives
    init_tensor_parallel(rank, size, store, cfg.device, cfg.enable_expert_parallel)
    try:
        runner, error = ModelRunner(ModelConfig.from_dir(cfg.model), cfg, max_model_len), None
        lora = rank_lora(runner, cfg)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        runner, error = None, f"rank {rank}: {exc}" if str(exc) else f"rank {rank}: {traceback.format_exc(limit=1)}"
    if loaded(error) is not None:
        return
    try:
        while (step := broadcast_object()) is not None:
            if isinstance(step, str) and step == SHARE_KV_POOL:
                to_rank0.send(shared(runner.kv_pool.data))  # the handle: its memory is not copied
            elif isinstance(step, PaddedDecodeStep):  # a padded (graph) decode step, overlapped or not
                run_padded_step(runner, step, lora)
            elif isinstance(step, StepInputs):
                if lora is not None:  # the step's adapters in their slots, as rank 0 put them
                    lora.apply(step.lora)
                runner.execute(step)
            else:  # a LoRA load or query (lora/ranks.py)
                lora.handle(step)
    except RankLost:  # rank 0 is gone (killed, crashed): nothing left to compute for
        return
    destroy_tensor_parallel()
