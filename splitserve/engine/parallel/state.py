"""This process's place in the tensor-parallel group: its rank, the group's size, whether
its MoE experts are spread whole over the ranks (expert parallelism), and the collectives
the sharded layers need (all-reduce, all-gather; all-to-all for expert parallelism).

One group per engine, so module state (as in nano-vllm and vLLM): the layers read it when
they are built and when they run, and a single-process engine (tp=1) never touches
torch.distributed. Gloo on the CPU, NCCL on CUDA."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts whole, E/size per rank (parallel/expert_parallel.py)


_state = TPState()
NO_TIMEOUT = timedelta(days=365)
# Under NCCL, the step descriptions go over a gloo group of the same ranks (vLLM's cpu_group):
# an object broadcast over NCCL stages its bytes on the device, behind the step in flight,
# which would make rank 0 wait for it (async scheduling launches the next step meanwhile).
_host_group = None


def tp() -> TPState:
    return _state


def init_tensor_parallel(rank: int, size: int, store: dist.Store, device: str, expert_parallel: bool = False) -> None:
    """Join the group over `store` (every rank calls this). No collective times out: a worker
    rank waits for the next step as long as rank 0 is idle, and rank 0 waits for a frozen rank
    until it thaws (each rank's heartbeat tells the worker meanwhile: group.silence); a dead
    peer fails the collective."""
    global _state, _host_group
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=NO_TIMEOUT)
    _host_group = dist.new_group(backend="gloo", timeout=NO_TIMEOUT) if backend == "nccl" else None
    _state = TPState(rank, size, expert_parallel)


def destroy_tensor_parallel() -> None:
    global _state, _host_group
    _host_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = TPState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of each rank's partial `x` (in place); x itself at tp=1."""
    if _state.size > 1:
        with _peers_alive():
            dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, in rank order."""
    if _state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    with _peers_alive():
        dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
    """Rows of `x` to the ranks (send_rows[r] consecutive rows to rank r, in rank order), and
    the rows every rank sent this one (recv_rows[r] from rank r, in rank order)."""
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    with _peers_alive():
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows)
    return out


class RankLost(RuntimeError):
    """Another rank's process is gone: this engine cannot run another step."""


@contextmanager
def _peers_alive():
    """A collective that fails means a peer is gone (gloo: "Connection reset/closed by peer"
    within milliseconds): RankLost, which ends the engine at once (async_engine.py)."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, RankLost):
            raise
        raise RankLost(f"tensor parallelism: a rank process is gone ({str(exc).splitlines()[0][:200]})") from exc


@contextmanager
def alone():
    """This process as a group of one while the block runs: a model built in it loads whole
    (unsharded) and runs no collective. Rank 0's draft model (engine/spec/draft_model.py)."""
    global _state
    mine = TPState()
    saved, _state = _state, mine
    try:
        yield
    finally:
        if _state is mine:  # not when the group was destroyed meanwhile (an engine closed on
            _state = saved  # another thread): restoring it would leave a dead group "running"


def broadcast_object(obj=None):
    """Rank 0's `obj` on every rank (the per-step description)."""
    box = [obj]
    with _peers_alive():
        dist.broadcast_object_list(box, src=0, group=_host_group)
    return box[0]


def broadcast_tensor(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (in place; on CUDA ordered on the stream, no host wait)."""
    with _peers_alive():
        dist.broadcast(x, src=0)
    return x


def gather_object(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (all ranks call it)."""
    out: list = [None] * _state.size
    with _peers_alive():
        dist.all_gather_object(out, obj)
    return out
