"""Runs one scheduled batch through the model: flattens the sequences' new tokens,
builds the paged-attention metadata, and returns logits where a token is due. Pure-decode
batches go through the CUDA-graph path (engine/cuda_graphs.py) when it is on, under tensor
parallelism too (each rank replays its own graphs). With LoRA on, the projections' LoRA
hooks are installed here, before any graph is captured (lora/layers.py).

A step is prepared (`prepare`: its StepInputs built, or the padded decode step staged),
then run (`run_prepared`); `run` does both. The runner knows nothing of other ranks: under
tensor parallelism the executor hands the prepared step to them in between
(engine/executor.py), and ranks 1..N-1 run what they receive (parallel/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.core.model_config import FULL, SLIDING, ModelConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphs
from splitserve.engine.expert_tokens import ExpertTokenCounts
from splitserve.engine.kv_cache import FP8, KVCachePool, KVCacheSpec, num_blocks_for_memory
from splitserve.engine.kv_scales import read_kv_scales
from splitserve.engine.models.layers import AttentionMetadata
from splitserve.engine.models.loader import load_model
from splitserve.engine.models.quant_moe import has_quantized_experts
from splitserve.engine.models.rope import RopeTable, rope_table
from splitserve.engine.parallel.sharding import kv_heads
from splitserve.engine.parallel.state import tp
from splitserve.engine.recurrent_state import RecurrentStatePool, RecurrentStateSpec, RecurrentStep
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.sequence import Sequence
from splitserve.engine.step_inputs import StepInputs, step_inputs
from splitserve.kernels import cpu_native, ops


@dataclass
class PreparedStep:
    """One step ready to run: what the other tensor-parallel ranks are sent before it runs here."""

    seqs: list[Sequence]  # eager: the sequences that get a token, in order; padded: the batch's decodes
    inputs: StepInputs | None = None  # an eager step's inputs (the message the other ranks run)
    bucket: int | None = None  # a padded decode step: the bucket its inputs are staged in


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, max_model_len: int, model_cls=None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        if self.device.type == "cpu" and ops.backend_for(torch.empty(0)) == "native":
            # built (a few seconds of g++ on a fresh machine) or loaded from its cache now, so
            # that no request waits for it and readiness means ready (CPU engines skip warm-up)
            cpu_native.library()
        self.block_size = cfg.block_size
        self.model = load_model(cfg.model, model_cfg, cfg.torch_dtype, self.device, cfg.quantization,
                                fp8_min_rows=cfg.fp8_activations_min_rows, model_cls=model_cls)
        if cfg.kv_torch_dtype == FP8:  # the checkpoint's per-layer scales of an fp8 KV cache, if it has them
            for layer, (k_scale, v_scale) in read_kv_scales(cfg.model, model_cfg.num_layers).items():
                attention = self.model.layers[layer].self_attn
                attention.k_scale, attention.v_scale = k_scale, v_scale
        full = rope_table(model_cfg.rope, model_cfg.head_dim, max_model_len, cfg.torch_dtype, self.device)
        local = full if model_cfg.local_rope is None else rope_table(
            model_cfg.local_rope, model_cfg.head_dim, max_model_len, cfg.torch_dtype, self.device)
        self.ropes: dict[str, RopeTable] = {FULL: full, SLIDING: local}
        # this rank's KV heads only (all of them at tp=1); a hybrid's recurrent layers have no KV
        spec = KVCacheSpec(len(model_cfg.kv_layers), kv_heads(model_cfg, tp())[1], model_cfg.head_dim,
                           cfg.block_size, cfg.kv_torch_dtype, model_cfg.kv_parts)
        # hybrids: a recurrent-state slot per sequence a step can hold (max_num_seqs), out of the same memory
        self.state_pool: RecurrentStatePool | None = None
        kv_memory = cfg.kv_cache_memory_bytes
        if model_cfg.is_hybrid:
            state_spec = RecurrentStateSpec.of(model_cfg, cfg.torch_dtype)
            self.state_pool = RecurrentStatePool(state_spec, cfg.max_num_seqs, self.device)
            kv_memory -= cfg.max_num_seqs * state_spec.slot_nbytes
            if cfg.num_kv_blocks is None and kv_memory < spec.block_nbytes:
                raise ValueError(f"{cfg.max_num_seqs} recurrent-state slots (max_num_seqs) take "
                                 f"{cfg.max_num_seqs * state_spec.slot_nbytes / 2**20:.1f} MiB, leaving no room for "
                                 f"KV in the KV cache memory ({cfg.kv_cache_memory_bytes / 2**20:.1f} MiB): lower "
                                 "max_num_seqs or give the KV cache more memory")
        num_blocks = cfg.num_kv_blocks or num_blocks_for_memory(spec, kv_memory)
        # one scratch block: where the padding rows of a fixed-shape decode batch write
        self.kv_pool = KVCachePool(spec, num_blocks, self.device, scratch_blocks=1)
        self.max_model_len = max_model_len
        self.lora = None  # the model's LoRA slots and hooks (lora/layers.py), before any capture
        if cfg.enable_lora:
            from splitserve.engine.lora.layers import lora_layers

            self.lora = lora_layers(self.model, cfg.max_loras, cfg.max_lora_rank, cfg.torch_dtype, self.device)
        # tokens per expert of each MoE layer, counted on the device by rank 0 (before any capture)
        self.expert_tokens = ExpertTokenCounts(self.model, self.device) if tp().rank == 0 else None
        self.decode_graphs: DecodeGraphs | None = None
        for module in self.model.modules():  # MLA's absorbed W_UK / W_UV: made now, never inside a capture
            if hasattr(module, "absorbed_weights"):
                module.absorbed_weights()
        # quantized experts read their token counts on the host, and DeepSeek sparse attention its
        # selection (models/dsa.py): no capture, the eager step
        if cfg.use_cuda_graphs and not has_quantized_experts(self.model) and not model_cfg.index_topk \
                and not model_cfg.is_hybrid:  # (a hybrid's recurrent layers read per-sequence slots)
            self.enable_decode_graphs(capture=True)
        elif cfg.async_scheduling:  # the overlapped decode runs the padded step (eagerly here)
            self.enable_decode_graphs(capture=False)

    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Run pure-decode batches padded to fixed buckets on static buffers: replayed from
        CUDA graphs captured now (`capture`, CUDA only), or eagerly (any device; the
        tests' way to check the padded step on the CPU)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_pool, self.ropes, self.cfg.max_num_seqs,
                                          self.max_model_len, self.block_size, self.device, capture,
                                          device_ids=self.cfg.async_scheduling, lora=self.lora)

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _block_tables(self, tables: list[list[int]]) -> torch.Tensor | None:
        if not tables:
            return None
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits [k, vocab] (float32) for the k sequences that reach their last known
        token this step (those get a new token), and those sequences in order."""
        return self.run_prepared(self.prepare(batch))

    @torch.inference_mode()
    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """The step's inputs: staged in the padded decode step's static input when the batch
        fits it, else built for the eager forward pass."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(batch):
            return PreparedStep(batch.decodes, bucket=graphs.stage(batch.decodes))
        step, sampled = step_inputs(batch, self.block_size)
        return PreparedStep(sampled, inputs=step)

    @torch.inference_mode()
    def run_prepared(self, step: PreparedStep) -> tuple[torch.Tensor, list[Sequence]]:
        """`run`'s result of a prepared step."""
        if step.bucket is None:
            return self.execute(step.inputs), step.seqs
        return self.decode_graphs.due(self.decode_graphs.execute(step.bucket), step.seqs)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:
        """The forward pass of one step; logits of its `logits_rows` tokens."""
        prefill = bool(step.prefill_lens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slots),
            num_prefill_tokens=sum(step.prefill_lens),
            prefill_block_tables=self._block_tables(step.prefill_block_tables),
            prefill_cu_seqlens_q=self._tensor(_cumsum(step.prefill_lens), torch.int32) if prefill else None,
            prefill_seq_lens=self._tensor(step.prefill_seq_lens, torch.int32) if prefill else None,
            decode_block_tables=self._block_tables(step.decode_block_tables),
            decode_seq_lens=self._tensor(step.decode_seq_lens, torch.int32) if step.decode_seq_lens else None,
        )
        if self.state_pool is not None:
            meta.recurrent = RecurrentStep.build(self.state_pool, step.state_slots or [], step.state_starts or [],
                                                 step.state_lens or [], len(step.prefill_lens))
        pos = self._tensor(step.positions)
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind, table in self.ropes.items():
            same = next((k for k, t in self.ropes.items() if t is table and k in ropes), None)
            if same is not None:
                ropes[kind] = ropes[same]
                continue
            rows = pos
            if table.long_after is not None and step.long_rope is not None:
                # longrope: long-factor rows for sequences past the switch
                rows = pos + self._tensor([table.long_offset if long else 0 for long in step.long_rope])
            ropes[kind] = (table.cos[rows], table.sin[rows])
        return self.model(self._tensor(step.input_ids), ropes, self.kv_pool, meta, self._tensor(step.logits_rows))


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
