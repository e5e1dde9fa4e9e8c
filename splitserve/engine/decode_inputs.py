"""The host side of a padded decode step's inputs, kept from step to step
(engine/cuda_graphs.py holds the step itself).

Each bucket owns one host buffer laid out like its graph's flat input
`[ids | slots | seq_lens | adapter slots (LoRA on) | rope rows per table | block tables]`
(pinned on CUDA, so the
copy to the device is asynchronous), filled through numpy, never through Python lists of
the whole step. Block tables are the bulk of it (bucket x ceil(max_model_len / block_size)
ids), and a decoding sequence's table changes once every block_size tokens, so each row
remembers whose table it holds and how much of it was written: a step writes a row's few
scalars and only the block ids appended since (usually none). A row that gets another
sequence (a new batch order, a preempted sequence's new table) is rewritten whole.

Why "the same list object, and no shorter" proves a row's written prefix is still right:
block_manager.py only ever extends a block table in place, replaces it with a new list
(a freed or re-admitted sequence) or cuts the blocks past the next token's (rejected drafts:
never one a decode step wrote), never edits an entry. The row keeps a reference to the
list, so its identity cannot be reused by another.

With LoRA on, a row's adapter slot (-1: the base model; padding rows too) is one more
scalar column: the graph's LoRA delta reads it (lora/apply.py, `row_slots`), so which rows
share an adapter is an input of the step, not part of the captured graph.

Entries past a row's length are left as they are (ids of earlier tables, all valid blocks):
the decode kernel masks block loads by the sequence length and never reads them. A padding
row decodes token 0 at position 0 with a one-token context held in the scratch block.

Measured on this project's 2-core CI machine, demo model, no forward pass (the host time of
a whole decode step): 0.55 / 2.40 / 5.86 ms at batch 32 / 128 / 256 when the inputs were built
from lists through torch.tensor, 0.17 / 0.76 / 2.22 ms staged (docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.engine.sequence import Sequence

PADDING = object()  # a row's owner when it is a padding row


@dataclass
class _BucketRows:
    host: torch.Tensor  # flat int64, the graph input's layout
    flat: np.ndarray  # numpy view of `host`
    tables: np.ndarray  # [bucket, width] view of its block-table part
    owners: list = field(default_factory=list)  # per row: the block-table list written there
    written: list[int] = field(default_factory=list)  # per row: its leading entries written
    copy_done: torch.cuda.Event | None = None  # the last copy out of `host` (pinned buffers)


class DecodeInputs:
    def __init__(self, width: int, block_size: int, scratch_block: int, rope_offsets: list[int],
                 device: torch.device, adapter_column: bool = False):
        """`rope_offsets`: per rope table of the model, the row offset of a long-rope
        sequence's positions (0 where the table has no long factors); `adapter_column`: the
        rows' LoRA slots follow seq_lens (LoRA on)."""
        self.width, self.block_size, self.scratch = width, block_size, scratch_block
        self.rope_offsets = rope_offsets
        self.pin = device.type == "cuda"
        self.adapters = int(adapter_column)
        self.columns = 3 + self.adapters + len(rope_offsets)  # scalars per row before the block tables
        self.buckets: dict[int, _BucketRows] = {}

    def size(self, bucket: int) -> int:
        return bucket * (self.columns + self.width)

    def host(self, bucket: int) -> torch.Tensor:
        """The bucket's host buffer (on the CPU it can be the step's input itself)."""
        return self._rows(bucket).host

    def _rows(self, bucket: int) -> _BucketRows:
        rows = self.buckets.get(bucket)
        if rows is None:
            host = torch.full((self.size(bucket),), self.scratch, dtype=torch.int64, pin_memory=self.pin)
            flat = host.numpy()
            tables = flat[self.columns * bucket:].reshape(bucket, self.width)
            rows = _BucketRows(host, flat, tables, [None] * bucket, [0] * bucket)
            self.buckets[bucket] = rows
        return rows

    def write(self, seqs: list[Sequence], bucket: int, adapter_slots: list[int] | None = None) -> torch.Tensor:
        """Fill the bucket's host buffer for `seqs` (each computes the token at its
        num_computed_tokens), padding rows after them; returns the buffer. `adapter_slots`:
        each sequence's LoRA slot (-1: none), when the buffer has that column."""
        n, bs, width = len(seqs), self.block_size, self.width
        if n > bucket:
            raise ValueError(f"{n} sequences do not fit a bucket of {bucket}")
        rows = self._rows(bucket)
        if rows.copy_done is not None:
            rows.copy_done.synchronize()  # the previous step's copy has left the buffer
            rows.copy_done = None
        ids, positions, slots, longs = [0] * n, [0] * n, [0] * n, [False] * n
        tables, owners, written = rows.tables, rows.owners, rows.written
        for i, seq in enumerate(seqs):
            pos, table = seq.num_computed_tokens, seq.block_table
            ids[i], positions[i], longs[i] = seq.token_ids[pos], pos, seq.long_rope
            slots[i] = table[pos // bs] * bs + pos % bs
            have = len(table)
            if owners[i] is table and written[i] <= have:
                if have > written[i]:
                    tables[i, written[i]:have] = table[written[i]:]
            else:
                if have > width:
                    raise ValueError(f"a block table of {have} blocks is wider than {width}")
                tables[i, :have] = table
                owners[i] = table
            written[i] = have
        for i in range(n, bucket):
            if owners[i] is not PADDING:
                tables[i, 0] = self.scratch
                owners[i], written[i] = PADDING, 1
        flat, b = rows.flat, bucket
        flat[0:n] = ids
        flat[n:b] = 0
        flat[b:b + n] = slots
        flat[b + n:2 * b] = self.scratch * bs
        pos = np.asarray(positions, dtype=np.int64)
        flat[2 * b:2 * b + n] = pos + 1  # seq_lens
        flat[2 * b + n:3 * b] = 1
        if self.adapters:
            flat[3 * b:3 * b + n] = adapter_slots if adapter_slots is not None else -1
            flat[3 * b + n:4 * b] = -1
        long_rows = np.asarray(longs, dtype=bool) if any(longs) else None
        for k, offset in enumerate(self.rope_offsets):
            start = (3 + self.adapters + k) * b
            flat[start:start + n] = pos if not offset or long_rows is None else pos + offset * long_rows
            flat[start + n:start + b] = 0
        return rows.host

    def copied(self, bucket: int) -> None:
        """The step's copy out of the bucket's pinned buffer was enqueued: the next write
        waits for it (by then it is long done: the step's sampling read the results)."""
        if self.pin:
            rows = self._rows(bucket)
            rows.copy_done = torch.cuda.Event()
            rows.copy_done.record()
