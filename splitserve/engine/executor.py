"""Where the model runs: in the engine's own process, or over tensor-parallel ranks.

LLMEngine schedules and samples; an executor owns everything below that which differs
between one process and N ranks, so neither the engine nor the ModelRunner has a
tensor-parallel branch:
- `run(batch, lora_plan)`: the step. The runner prepares it (ModelRunner.prepare: the eager
  step's StepInputs, or the padded decode step staged in its bucket); under TP it is then
  broadcast to the other ranks (the StepInputs with the step's LoRA plan, or a
  PaddedDecodeStep: parallel/padded_decode.py), and rank 0 runs its own slice last;
- `run_padded(seqs, lora_plan)`: the overlapped decode's launch (engine/overlap.py), the
  padded step staged, broadcast under TP, run;
- `runner`: rank 0's ModelRunner (its model, pool and graphs, for the engine's setup);
- `check_ranks()`: a rank process gone raises its RankLost before a step; `silence()`: the
  longest a rank has gone without a heartbeat, for the worker's health (frozen, starved);
- the KV pool as readers other than the step see it (`kv_pool`, `share_kv_pool()`,
  `transfer_pool()`): the runner's own pool at tp=1, every rank's heads as one pool under TP
  (parallel/kv_shards.py);
- `close()`: the ranks ended (idempotent; nothing to do at tp=1).

The rank processes themselves live in parallel/group.py (rank 0's side) and
parallel/worker.py (ranks 1..N-1)."""

from __future__ import annotations

from typing import Protocol

import torch

from splitserve.core.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCachePool
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.group import TensorParallelGroup
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.engine.parallel.padded_decode import send_padded_step
from splitserve.engine.parallel.sharding import check_shardable
from splitserve.engine.parallel.state import broadcast_object, tp
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.sequence import Sequence


class Executor(Protocol):
    runner: ModelRunner

    def run(self, batch: ScheduledBatch, lora_plan) -> tuple[torch.Tensor, list[Sequence]]: ...
    def run_padded(self, seqs: list[Sequence], lora_plan) -> torch.Tensor: ...
    def check_ranks(self) -> None: ...
    def silence(self) -> tuple[float, str] | None: ...
    @property
    def kv_pool(self) -> KVCachePool | ShardedKVPool: ...
    def share_kv_pool(self) -> KVCachePool | ShardedKVPool: ...
    def transfer_pool(self) -> KVCachePool | ShardedKVPool: ...
    def close(self) -> None: ...


def build_executor(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> Executor:
    """The executor `config.tensor_parallel_size` asks for, its model loaded (one line when
    the checkpoint cannot be split that many ways)."""
    check_shardable(model_config, config.tensor_parallel_size, config.model)
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(config, model_config, max_model_len)
    if tp().size > 1:  # its layers would load rank 0's slices and wait in the ranks' collectives
        raise RuntimeError("a single-process engine cannot start in a process that runs a tensor-parallel "
                           "engine: close that one first, or start this one in another process")
    return SingleProcessExecutor(ModelRunner(model_config, config, max_model_len))


class SingleProcessExecutor:
    """The model in this process: no ranks to watch, start or end."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def run(self, batch: ScheduledBatch, lora_plan) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits where a token is due, and those sequences (ModelRunner.run); the LoRA plan
        is for other ranks: here the slots are set already (LoRAManager.prepare)."""
        return self.runner.run(batch)

    @torch.inference_mode()
    def run_padded(self, seqs: list[Sequence], lora_plan) -> torch.Tensor:
        """Logits [bucket, vocab] of the padded decode step of `seqs` (cuda_graphs.py)."""
        graphs = self.runner.decode_graphs
        return graphs.execute(graphs.stage(seqs))

    def check_ranks(self) -> None:
        pass

    def silence(self) -> None:
        return None

    @property
    def kv_pool(self) -> KVCachePool:
        return self.runner.kv_pool

    def share_kv_pool(self) -> KVCachePool:
        """The pool moved into shared memory, in place (the runner's views follow it), for an
        engine process's worker."""
        self.runner.kv_pool.data.share_memory_()
        return self.runner.kv_pool

    def transfer_pool(self) -> KVCachePool:
        """The pool for readers on other threads (offload tiers, a thread engine's worker): itself."""
        return self.runner.kv_pool

    def close(self) -> None:
        pass


class TensorParallelExecutor:
    """Rank 0 here, ranks 1..N-1 in processes of their own (parallel/group.py)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.model_config = model_config
        self.group = TensorParallelGroup(config)
        self._sharded_pool: ShardedKVPool | None = None  # once share_kv_pool() ran
        try:  # ranks 1..N-1 load their slices alongside this one
            self.group.start(max_model_len)
            self.runner = self.group.load(lambda: ModelRunner(model_config, self.group.cfg, max_model_len))
        except BaseException:
            self.group.close()  # (idempotent: start and load end the ranks on their own errors)
            raise

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, lora_plan) -> tuple[torch.Tensor, list[Sequence]]:
        """The step prepared here, sent to ranks 1..N-1 (which run it on their slices:
        parallel/worker.py), then run on rank 0's slice."""
        step = self.runner.prepare(batch)
        if step.bucket is not None:  # the padded decode step (parallel/padded_decode.py)
            send_padded_step(self.runner.decode_graphs, step.bucket, lora_plan)
        else:
            step.inputs.lora = lora_plan  # the ranks put the step's adapters in their slots (lora/ranks.py)
            broadcast_object(step.inputs)
        return self.runner.run_prepared(step)

    @torch.inference_mode()
    def run_padded(self, seqs: list[Sequence], lora_plan) -> torch.Tensor:
        """The overlapped decode's step: staged, sent with the previous step's tokens (their
        placeholders are read on every rank), run on rank 0's slice."""
        graphs = self.runner.decode_graphs
        bucket = graphs.stage(seqs)
        send_padded_step(graphs, bucket, lora_plan)
        return graphs.execute(bucket)

    def check_ranks(self) -> None:
        """A rank process gone before the step: said now. Gloo does not always fail a collective
        whose peer died (a broadcast from rank 0 only sends): the step could block for good."""
        lost = self.group.lost_rank()
        if lost is not None:
            raise lost

    def silence(self) -> tuple[float, str] | None:
        return self.group.silence()

    @property
    def kv_pool(self) -> ShardedKVPool:
        """Every rank's heads as one pool, once share_kv_pool() ran."""
        if self._sharded_pool is None:
            raise RuntimeError("a tensor-parallel engine's KV pool is read through share_kv_pool() "
                               "(rank 0 holds only its KV heads)")
        return self._sharded_pool

    def share_kv_pool(self) -> ShardedKVPool:
        """Every rank's pool, shared with this process, as one (parallel/kv_shards.py). The first
        call is a broadcast to the ranks: make it between steps, before steps run on another thread."""
        if self._sharded_pool is None:
            pool = self.runner.kv_pool
            shards = self.group.share_kv_pools(pool.data)
            self._sharded_pool = ShardedKVPool.of(self.model_config, pool.spec, pool.num_blocks, shards)
        return self._sharded_pool

    def transfer_pool(self) -> ShardedKVPool:
        """Readers on other threads need every rank's heads (kv_offload/device_blocks.py)."""
        return self.share_kv_pool()

    def close(self) -> None:
        """Stop the other ranks and leave the group; idempotent (an engine's finalizer calls it
        again after close())."""
        self.group.close()
