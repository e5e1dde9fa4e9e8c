"""Whether a model can run expert-parallel (--enable-expert-parallel, engine/parallel/
expert_parallel.py) over `size` tensor-parallel ranks: one line saying why not, or None.
Torch-free, so that serve and the workers refuse it before any process starts."""

from __future__ import annotations

from splitserve.core.model_config import ModelConfig


def expert_parallel_problem(cfg: ModelConfig | None, size: int) -> str | None:
    """`cfg` None: the checkpoint is not readable here (the loader says why later)."""
    if size <= 1:
        return "expert parallelism spreads the experts over the tensor-parallel ranks: it needs tensor " \
               "parallelism (size > 1)"
    if cfg is None:
        return None
    if not cfg.num_experts or not cfg.moe_layers:
        return f"{cfg.architecture} has no mixture-of-experts layers: expert parallelism needs an MoE model"
    if cfg.num_experts % size:
        return f"{cfg.architecture}'s {cfg.num_experts} experts do not split evenly over {size} ranks"
    return None
