"""Where the model runs: in the engine's own process, or over tensor-parallel ranks.

LLMEngine schedules and samples; an executor owns everything below that which differs
between one process and N ranks, so the engine has no tensor-parallel branch:
- `runner`: rank 0's ModelRunner (under TP, ModelRunner.run broadcasts each step's inputs
  to the other ranks before running its own slice);
- `check_ranks()`: a rank process gone raises its RankLost before a step; `silence()`: the
  longest a rank has gone without a heartbeat, for the worker's health (frozen, starved);
- the KV pool as readers other than the step see it (`kv_pool`, `share_kv_pool()`,
  `transfer_pool()`): the runner's own pool at tp=1, every rank's heads as one pool under TP
  (parallel/kv_shards.py);
- `follow_padded_step(...)`: an overlapped decode step's inputs to the other ranks;
- `close()`: the ranks ended (idempotent; nothing to do at tp=1).

The rank processes themselves live in parallel/group.py (rank 0's side) and
parallel/worker.py (ranks 1..N-1)."""

from __future__ import annotations

from typing import Protocol

from splitserve.core.model_config import ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCachePool
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.parallel.group import TensorParallelGroup
from splitserve.engine.parallel.kv_shards import ShardedKVPool
from splitserve.engine.parallel.padded_decode import send_padded_step
from splitserve.engine.parallel.sharding import check_shardable


class Executor(Protocol):
    runner: ModelRunner

    def check_ranks(self) -> None: ...
    def silence(self) -> tuple[float, str] | None: ...
    @property
    def kv_pool(self) -> KVCachePool | ShardedKVPool: ...
    def share_kv_pool(self) -> KVCachePool | ShardedKVPool: ...
    def transfer_pool(self) -> KVCachePool | ShardedKVPool: ...
    def follow_padded_step(self, graphs, bucket: int, lora_plan) -> None: ...
    def close(self) -> None: ...


def build_executor(config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> Executor:
    """The executor `config.tensor_parallel_size` asks for, its model loaded (one line when
    the checkpoint cannot be split that many ways)."""
    check_shardable(model_config, config.tensor_parallel_size, config.model)
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(config, model_config, max_model_len)
    return SingleProcessExecutor(ModelRunner(model_config, config, max_model_len))


class SingleProcessExecutor:
    """The model in this process: no ranks to watch, start or end."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

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

    def follow_padded_step(self, graphs, bucket: int, lora_plan) -> None:
        pass  # no other rank runs the step

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

    def follow_padded_step(self, graphs, bucket: int, lora_plan) -> None:
        """The other ranks run the same padded decode step (parallel/padded_decode.py)."""
        send_padded_step(graphs, bucket, lora_plan)

    def close(self) -> None:
        """Stop the other ranks and leave the group; idempotent (an engine's finalizer calls it
        again after close())."""
        self.group.close()
