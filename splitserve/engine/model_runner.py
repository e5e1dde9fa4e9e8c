"""Runs one scheduled batch through the model: flattens the sequences' new tokens,
builds the paged-attention metadata, and returns logits where a token is due. Pure-decode
batches go through the CUDA-graph path (engine/cuda_graphs.py) when it is on."""

from __future__ import annotations

import torch

from splitserve.core.model_config import FULL, SLIDING, ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.kv_cache import FP8, KVCachePool, KVCacheSpec, num_blocks_for_memory
from splitserve.engine.kv_scales import read_kv_scales
from splitserve.engine.models.layers import AttentionMetadata
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.rope import RopeTable, rope_table
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.block_size = cfg.block_size
        self.model = load_model(cfg.model, model_cfg, cfg.torch_dtype, self.device, cfg.quantization)
        if cfg.kv_torch_dtype == FP8:  # the checkpoint's per-layer scales of an fp8 KV cache, if it has them
            for layer, (k_scale, v_scale) in read_kv_scales(cfg.model, model_cfg.num_layers).items():
                attention = self.model.layers[layer].self_attn
                attention.k_scale, attention.v_scale = k_scale, v_scale
        full = rope_table(model_cfg.rope, model_cfg.head_dim, max_model_len, cfg.torch_dtype, self.device)
        local = full if model_cfg.local_rope is None else rope_table(
            model_cfg.local_rope, model_cfg.head_dim, max_model_len, cfg.torch_dtype, self.device)
        self.ropes: dict[str, RopeTable] = {FULL: full, SLIDING: local}
        spec = KVCacheSpec(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                           cfg.block_size, cfg.kv_torch_dtype)
        num_blocks = cfg.num_kv_blocks or num_blocks_for_memory(spec, cfg.kv_cache_memory_bytes)
        # one scratch block: where the padding rows of a fixed-shape decode batch write
        self.kv_pool = KVCachePool(spec, num_blocks, self.device, scratch_blocks=1)
        self.max_model_len = max_model_len
        self.decode_graphs: DecodeGraphs | None = None
        if cfg.use_cuda_graphs:
            self.enable_decode_graphs(capture=True)

    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Run pure-decode batches padded to fixed buckets on static buffers: replayed from
        CUDA graphs captured now (`capture`, CUDA only), or eagerly (any device; the
        tests' way to check the padded step on the CPU)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_pool, self.ropes, self.cfg.max_num_seqs,
                                          self.max_model_len, self.block_size, self.device, capture)

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [k, vocab] (float32) for the k sequences that reach their last known
        token this step (those get a new token), and those sequences in order."""
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return self.decode_graphs.run(batch)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in batch.entries:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)

        prefill_seqs = [s for s, _ in batch.prefills]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_prefill_tokens=sum(n for _, n in batch.prefills),
            prefill_block_tables=self._block_tables(prefill_seqs) if prefill_seqs else None,
            prefill_cu_seqlens_q=self._tensor(_cumsum([n for _, n in batch.prefills]), torch.int32)
            if prefill_seqs else None,
            prefill_seq_lens=self._tensor([s.num_computed_tokens + n for s, n in batch.prefills], torch.int32)
            if prefill_seqs else None,
            decode_block_tables=self._block_tables(batch.decodes) if batch.decodes else None,
            decode_seq_lens=self._tensor([s.num_computed_tokens + 1 for s in batch.decodes], torch.int32)
            if batch.decodes else None,
        )
        pos = self._tensor(positions)
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind, table in self.ropes.items():
            same = next((k for k, t in self.ropes.items() if t is table and k in ropes), None)
            if same is not None:
                ropes[kind] = ropes[same]
                continue
            rows = pos
            if table.long_after is not None:  # longrope: long-factor rows for sequences past the switch
                offsets = [table.long_offset if seq.long_rope else 0 for seq, n in batch.entries for _ in range(n)]
                rows = pos + self._tensor(offsets)
            ropes[kind] = (table.cos[rows], table.sin[rows])
        logits = self.model(self._tensor(input_ids), ropes, self.kv_pool, meta, self._tensor(logits_rows))
        return logits, sampled


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
