"""Tensor parallelism (issue 32): ranks under torch.distributed, sharded layers, the
per-step broadcast. docs/architecture.md, "Tensor parallelism"."""
