"""CUDA-graph capture and replay of pure-decode steps.

A decode step of a small batch is a few hundred short kernels; launched one by one from
Python the GPU idles between them. A CUDA graph records the launches once and replays
them with one call. A graph fixes every shape and pointer, so the step is run on static
buffers of a fixed batch size (a *bucket*: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs):

- a batch of n decodes is padded up to the smallest bucket >= n. A padding row decodes
  token 0 at position 0 with a context of one token, its block table and its slot in
  the pool's scratch block (KVCachePool.scratch_block), so it never reads or writes the
  KV of a real sequence and its (discarded) output stays finite;
- block tables are always `blocks_per_seq(max_model_len)` wide (padded with the scratch
  block), and lengths, slots and rope rows are device tensors read by the kernels: no
  value is read on the host during the step (the Triton decode kernel sizes its splits
  from the table width, not from the lengths);
- every per-step input is one flat int64 tensor, copied to the device once per step; the
  graph slices and converts it itself.

Graphs are captured at start-up, largest bucket first, into one shared memory pool: the
largest graph sizes the pool and the smaller ones reuse its memory, and no request pays
for a capture (vLLM does the same). Steps with prefill tokens, or more decodes than the
largest bucket, run eagerly.

With `capture=False` the same padded static-buffer step runs eagerly: this is how the
CPU tests check that padding changes no result, where no capture is possible.

LoRA: each row's adapter slot is one more column of the static input (padding and base
rows: -1), and the projections' deltas are gathered by that slot row by row (lora/apply.py
`row_slots`), so one graph serves every mix of adapters. Tensor parallelism: every rank
holds its own graphs over its slices, captured at start-up in the same bucket order (their
all-reduces are NCCL collectives inside the graph); rank 0 stages the step and broadcasts
its flat input (parallel/padded_decode.py), and each rank replays the same bucket.
"""

from __future__ import annotations

import torch

from splitserve.engine.decode_inputs import DecodeInputs
from splitserve.engine.models.layers import AttentionMetadata
from splitserve.engine.models.rope import RopeTable
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.sequence import Sequence
from splitserve.kernels import ops


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes a graph is captured for: 1, 2, 4, then multiples of 8, and
    max_num_seqs itself, so every decode batch the scheduler can form fits one."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows (None: larger than every bucket)."""
    return next((b for b in buckets if b >= n), None)


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """Block-table width that holds any sequence the engine accepts."""
    return -(-max_model_len // block_size)


class DecodeGraphs:
    """The padded static-buffer decode step, per bucket, replayed from CUDA graphs
    (`capture=True`, CUDA only) or run eagerly (`capture=False`)."""

    def __init__(self, model, kv_pool, ropes: dict[str, RopeTable], max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, capture: bool = True, device_ids: bool = False,
                 lora=None):
        """`lora`: the model's LoRALayers (lora/layers.py) when LoRA is on, hooks installed."""
        if kv_pool.scratch_block is None:
            raise ValueError("the decode graphs need a KV pool with a scratch block (scratch_blocks=1)")
        self.model, self.kv_pool, self.ropes = model, kv_pool, ropes
        self.buckets = batch_buckets(max_num_seqs)
        self.width = blocks_per_seq(max_model_len, block_size)
        self.block_size, self.device, self.capture = block_size, device, capture
        self.scratch = kv_pool.scratch_block
        # one rope-row column per distinct table (a model's local and global tables may be one)
        self.tables: list[RopeTable] = []
        for table in ropes.values():
            if not any(t is table for t in self.tables):
                self.tables.append(table)
        offsets = [t.long_offset if t.long_after is not None else 0 for t in self.tables]
        self.lora = lora
        self.staging = DecodeInputs(self.width, block_size, self.scratch, offsets, device,
                                    adapter_column=lora is not None)
        self.inputs: dict[int, torch.Tensor] = {}  # bucket -> static flat input buffer
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> logits written by its graph
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps = 0  # decode steps run through this path (replayed or padded eagerly)
        # The overlapped decode (engine/overlap.py): an input id -(j + 1) is the token row j of
        # the previous step sampled, still on the device; the step reads it from here.
        self.previous_tokens = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device) \
            if device_ids else None
        if capture:
            self._check_capturable()
            self.pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.buckets):  # largest first: it sizes the shared pool
                self._capture(bucket)

    def _check_capturable(self) -> None:
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise RuntimeError(f"CUDA graphs need a CUDA device, the engine runs on {self.device}; "
                               "turn them off (--no-cuda-graphs, EngineConfig(cuda_graphs=False))")
        probe = torch.empty(1, device=self.device)
        if ops.backend_for(probe) != "triton":
            raise RuntimeError("CUDA graphs need the Triton kernels: the torch reference reads lengths on "
                               "the host, which a graph cannot hold; unset SPLITSERVE_KERNELS or turn "
                               "CUDA graphs off")

    # ---- per step ---------------------------------------------------------------------
    def fits(self, batch: ScheduledBatch) -> bool:
        """Pure decode, at most the largest bucket, every table within the fixed width."""
        return (not batch.prefills and 0 < len(batch.decodes) <= self.buckets[-1]
                and all(len(s.block_table) <= self.width for s in batch.decodes))

    def due(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """ModelRunner.run's result from the executed bucket's `logits` of decodes `seqs`."""
        # a one-token entry is not sampled when it is not the sequence's last known token
        rows = [i for i, s in enumerate(seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        if len(rows) == len(seqs):  # a view of the graph's output: sampled before the next replay
            return logits[: len(seqs)], seqs
        return logits[rows], [seqs[i] for i in rows]

    def stage(self, seqs: list[Sequence], bucket: int | None = None) -> int:
        """Write the step's inputs into its bucket's static buffer; returns the bucket
        (by default the smallest that holds them)."""
        bucket = bucket or bucket_for(len(seqs), self.buckets)
        adapter_slots = [self.lora.slot_of(s) for s in seqs] if self.lora is not None else None
        host = self.staging.write(seqs, bucket, adapter_slots)
        static = self._input(bucket)
        if static is not host:
            static.copy_(host, non_blocking=True)
            self.staging.copied(bucket)
        return bucket

    def stage_flat(self, flat: torch.Tensor, bucket: int) -> None:
        """The bucket's inputs as another rank staged them (parallel/padded_decode.py)."""
        self._input(bucket).copy_(flat)

    def execute(self, bucket: int) -> torch.Tensor:
        """Logits [bucket, vocab] of the staged step: the graph replayed, or run eagerly."""
        self.steps += 1
        if self.capture:
            self.graphs[bucket].replay()
            return self.outputs[bucket]
        return self._forward(self.inputs[bucket], bucket)

    def _input(self, bucket: int) -> torch.Tensor:
        if bucket not in self.inputs:
            if self.device.type == "cpu":  # the host buffer is the step's input: no copy
                self.inputs[bucket] = self.staging.host(bucket)
            else:
                self.inputs[bucket] = torch.zeros(self.staging.size(bucket), dtype=torch.int64, device=self.device)
        return self.inputs[bucket]

    # ---- the step the graph holds -----------------------------------------------------
    def _forward(self, flat: torch.Tensor, bucket: int) -> torch.Tensor:
        """Logits [bucket, vocab] of the padded step held in `flat`: only device ops."""
        b = bucket
        ids, slots, seq_lens = flat[:b], flat[b : 2 * b], flat[2 * b : 3 * b].to(torch.int32)
        if self.previous_tokens is not None:
            ids = torch.where(ids >= 0, ids, self.previous_tokens[(-1 - ids).clamp_min(0)])
        start = 3 * b
        adapter_slots = None
        if self.lora is not None:
            adapter_slots, start = flat[start : start + b], start + b
        rows = {}
        for table in self.tables:
            rows[id(table)] = flat[start : start + b]
            start += b
        tables = flat[start : start + b * self.width].view(b, self.width).to(torch.int32)
        meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0, prefill_block_tables=None,
                                 prefill_cu_seqlens_q=None, prefill_seq_lens=None,
                                 decode_block_tables=tables, decode_seq_lens=seq_lens)
        cos_sin = {id(t): (t.cos[rows[id(t)]], t.sin[rows[id(t)]]) for t in self.tables}
        ropes = {kind: cos_sin[id(table)] for kind, table in self.ropes.items()}
        every_row = torch.arange(b, device=self.device)
        if self.lora is None:
            return self.model(ids, ropes, self.kv_pool, meta, every_row)
        step = self.lora.step
        # a graph gathers by slot always; an eager step with no adapted row skips the deltas
        step.row_slots = adapter_slots if self.capture or step.perm is not None else None
        try:
            return self.model(ids, ropes, self.kv_pool, meta, every_row)
        finally:
            step.row_slots = None

    @torch.inference_mode()
    def _capture(self, bucket: int) -> None:
        """Warm up (Triton compiles outside the capture), then record the padded step;
        the static input holds padding rows only, which touch the scratch block alone."""
        self.stage([], bucket)  # padding rows only: they touch the scratch block alone
        static = self.inputs[bucket]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(static, bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bucket] = self._forward(static, bucket)
        self.graphs[bucket] = graph
