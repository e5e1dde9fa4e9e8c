"""Rank 0's side of a tensor-parallel engine: starts ranks 1..N-1 as processes (spawned,
so each has its own torch and its own slice), joins the group with them, and ends them.

The scheduler, block manager, prefix cache and sampler stay in rank 0 (the engine's own
process); the executor broadcasts each step's inputs before rank 0 runs it. The engine
reaches this group only through its executor (engine/executor.py, TensorParallelExecutor).
Gloo on the CPU: the collectives go over loopback TCP; NCCL on CUDA."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401 - registers the shared-memory pickling of tensors

from splitserve.core.model_config import CheckpointError
from splitserve.engine.config import EngineConfig
from splitserve.engine.parallel.state import (
    NO_TIMEOUT,
    RankLost,
    broadcast_object,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp,
)
from splitserve.engine.parallel.worker import (
    SHARE_KV_POOL,
    cpu_threads,
    loaded,
    rank_config,
    run_rank,
    shared,
)

log = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 300.0  # a rank that never joins (slow start, wedged): an error, not a hang


class TensorParallelGroup:
    def __init__(self, cfg: EngineConfig):
        if tp().size > 1:
            raise RuntimeError("this process already runs a tensor-parallel engine (one per process)")
        self.size = cfg.tensor_parallel_size
        self.cfg = rank_config(cfg, 0)
        # rank 0 hosts the rendezvous store on a free port (port 0: the OS picks)
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, timeout=NO_TIMEOUT,
                                   wait_for_workers=False)
        self.procs: list[mp.Process] = []
        # each rank's last heartbeat (time.monotonic(), written by the rank: worker.beat)
        self.beats = mp.get_context("spawn").RawArray("d", self.size)
        self.from_ranks: list = []  # one pipe from each rank: its KV pool handle (share_kv_pools)
        self.threads = torch.get_num_threads()
        self.running = False
        self.closed = False

    def start(self, max_model_len: int) -> None:
        """Start ranks 1..N-1 and join the group as rank 0 (before rank 0 loads its slice)."""
        ctx = mp.get_context("spawn")
        self.beats[:] = [time.monotonic()] * self.size  # (a rank beats from its first line on)
        for rank in range(1, self.size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_rank, name=f"splitserve-tp-rank{rank}", daemon=True,
                               args=(rank, self.size, self.store.port, self.cfg, max_model_len, writer,
                                     self.beats))
            proc.start()
            writer.close()  # the rank's end only: its death then ends the pipe
            self.procs.append(proc)
            self.from_ranks.append(reader)
        if torch.device(self.cfg.device).type == "cpu":
            torch.set_num_threads(cpu_threads(self.size))
        self.wait_for_ranks()
        init_tensor_parallel(0, self.size, self.store, self.cfg.device, self.cfg.enable_expert_parallel)
        self.running = True
        log.info("tensor-parallel engine: %d ranks over %s (rank processes %s)", self.size,
                 "nccl" if torch.device(self.cfg.device).type == "cuda" else "gloo",
                 ", ".join(str(p.pid) for p in self.procs))

    def wait_for_ranks(self) -> None:
        """Until every rank has reached the store; one line if one died or never came."""
        keys = [f"joined{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not self.store.check(keys):
            dead = [p for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                why = f"exited with code {dead[0].exitcode}" if dead else f"did not start in {JOIN_TIMEOUT_S:.0f} s"
                raise RuntimeError(f"tensor parallelism: rank process {why} (a script that starts one needs an "
                                   "`if __name__ == '__main__':` guard: ranks are spawned)")
            time.sleep(0.05)

    def load(self, make_runner):
        """Rank 0's runner, once every rank has loaded its slice; else the first rank's error
        (rank 0's own exception as it is), the other ranks ended."""
        try:
            runner = make_runner()
        except Exception as exc:
            loaded(f"rank 0: {exc}")  # the other ranks learn it and return
            self.running = False
            self.close()
            raise
        first = loaded(None)
        if first is not None:
            self.running = False
            self.close()
            raise CheckpointError(first)
        return runner

    def share_kv_pools(self, own: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's KV pool tensor, in rank order, shared with this process (rank 0's
        own first): for the KV transfer of the worker (parallel/kv_shards.py). Call it between
        steps: it is a broadcast like a step's."""
        broadcast_object(SHARE_KV_POOL)
        pools = [shared(own)]
        for rank, pipe in enumerate(self.from_ranks, start=1):
            try:
                if not pipe.poll(JOIN_TIMEOUT_S):
                    raise EOFError
                pools.append(pipe.recv())
            except (EOFError, OSError):
                raise RankLost(f"tensor parallelism: rank {rank} did not hand over its KV pool "
                               f"(its process {'is gone' if not self.procs[rank - 1].is_alive() else 'is stuck'})"
                               ) from None
        return pools

    def lost_rank(self) -> RankLost | None:
        """A rank process that ended while the group runs (the engine may be idle and not
        know yet): the engine cannot run another step."""
        dead = next((p for p in self.procs if not p.is_alive()), None) if self.running else None
        if dead is None:
            return None
        return RankLost(f"tensor parallelism: a rank process is gone (pid {dead.pid}, {dead.name}, "
                        f"exit code {dead.exitcode})")

    def silence(self) -> tuple[float, str] | None:
        """(seconds, which) of the rank process that has gone longest without a heartbeat;
        None when the group does not run. A rank frozen (SIGSTOP) or starved of CPU lives, so
        lost_rank says nothing, and rank 0 waits in the step's collective for as long as it is
        silent: the worker judges the silence against its heartbeat timeout, as it judges its
        engine process's (EngineProcess.health, AsyncEngine.health)."""
        if not self.running or self.size == 1:
            return None
        now = time.monotonic()
        age, rank = max((now - self.beats[rank], rank) for rank in range(1, self.size))
        return age, f"tensor-parallel rank {rank} (pid {self.procs[rank - 1].pid})"

    def close(self) -> None:
        """Stop the other ranks (a None step) and leave the group. Idempotent: a second call
        (the engine's finalizer, run by the collector after close()) must not destroy the group
        of a later engine in this process (its load then failed with shapes of an unsharded model)."""
        if self.closed:
            return
        self.closed = True
        if self.running:
            self.running = False
            try:
                broadcast_object(None)
            except RuntimeError:  # a rank died: the others are ended below
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self.procs = []
        for pipe in self.from_ranks:
            pipe.close()
        self.from_ranks = []
        destroy_tensor_parallel()
        torch.set_num_threads(self.threads)
