"""A Llama-shaped decoder built straight from `splitserve.kernels.ops` (its matmuls through
ops.linear, as the engine's), for the kernel benchmark. Not the engine's model class: no checkpoint, no scheduler,
random weights - just the per-step work (norms, rotary, KV store, paged attention,
projections, MLP, last-token logits) with byte and FLOP accounting next to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.kv_cache import KVCachePool, KVCacheSpec
from splitserve.kernels import ops


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int = 32
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    block_size: int = 16
    rms_eps: float = 1e-5

    @property
    def qkv_out(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        q_size = self.num_heads * self.head_dim
        return (self.hidden * self.qkv_out + q_size * self.hidden
                + self.hidden * 2 * self.intermediate + self.intermediate * self.hidden)

    def weight_bytes_per_step(self, batch: int, elem: int) -> int:
        """Weights a decode step reads: every layer, the final norm and the LM head in full;
        of the embedding table only the rows of this step's tokens."""
        per_layer = self.layer_matmul_params + 2 * self.hidden
        return (self.num_layers * per_layer + self.hidden + self.vocab * self.hidden + batch * self.hidden) * elem

    def kv_bytes_read(self, total_context_tokens: int, elem: int) -> int:
        return total_context_tokens * self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def prefill_flops(self, tokens: int) -> int:
        """Matmul FLOPs of one prompt: projections and MLP for every token, causal attention
        (QK^T and PV over tokens*(tokens+1)/2 pairs), logits for the last token only."""
        linear = 2 * tokens * self.num_layers * self.layer_matmul_params
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * tokens * (tokens + 1) // 2
        return linear + attention + 2 * self.vocab * self.hidden


LLAMA3_8B = LlamaShape()
TOY = LlamaShape(num_layers=2, hidden=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate=256, vocab=512)


@dataclass
class StepInputs:
    """One forward pass: tokens, their positions, where their K/V go, attention metadata."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None  # None: a decode step (one token per sequence)
    logit_rows: torch.Tensor


class BenchModel:
    def __init__(self, shape: LlamaShape, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 max_position: int, seed: int = 0):
        self.shape, self.dtype, self.device = shape, dtype, device
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(*dims):
            return (torch.randn(dims, generator=gen, device=device, dtype=dtype) * 0.02)

        s = shape
        self.embed = weight(s.vocab, s.hidden)
        self.layers = [
            {"in_norm": torch.ones(s.hidden, dtype=dtype, device=device), "qkv": weight(s.qkv_out, s.hidden),
             "o": weight(s.hidden, s.num_heads * s.head_dim),
             "post_norm": torch.ones(s.hidden, dtype=dtype, device=device),
             "gate_up": weight(2 * s.intermediate, s.hidden), "down": weight(s.hidden, s.intermediate)}
            for _ in range(s.num_layers)
        ]
        self.final_norm = torch.ones(s.hidden, dtype=dtype, device=device)
        self.lm_head = weight(s.vocab, s.hidden)
        spec = KVCacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, s.block_size, dtype)
        self.kv = KVCachePool(spec, num_blocks, device)
        self.kv.data.normal_(generator=gen)  # stands in for the context already cached
        inv_freq = 1.0 / 500000.0 ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim)
        angles = torch.arange(max_position, device=device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, step: StepInputs) -> torch.Tensor:
        s = self.shape
        n = step.tokens.shape[0]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        scale = s.head_dim ** -0.5
        x = self.embed[step.tokens]
        cos, sin = self.cos[step.positions], self.sin[step.positions]
        pending = None  # the last MLP output, added to x by the next norm (engine/models/llama.py)
        for i, layer in enumerate(self.layers):
            if pending is None:
                h = ops.rms_norm(x, layer["in_norm"], s.rms_eps)
            else:
                x, h = ops.add_rms_norm(x, pending, layer["in_norm"], s.rms_eps)
            q, k, v = ops.linear(h, layer["qkv"]).split([q_size, kv_size, kv_size], dim=-1)
            k_cache, v_cache = self.kv.layer(i)
            q = ops.rotary_and_store_kv(q.view(n, s.num_heads, s.head_dim), k.view(n, s.num_kv_heads, s.head_dim),
                                        v.view(n, s.num_kv_heads, s.head_dim), cos, sin, k_cache, v_cache,
                                        step.slot_mapping)
            if step.cu_seqlens_q is None:
                o = ops.paged_decode_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, scale)
            else:
                o = ops.paged_prefill_attention(q, k_cache, v_cache, step.block_tables, step.cu_seqlens_q,
                                                step.seq_lens, scale)
            # as the engine's layer: add + norm fused, act(gate) * up fused
            x, h = ops.add_rms_norm(x, ops.linear(o.reshape(n, q_size), layer["o"]), layer["post_norm"], s.rms_eps)
            pending = ops.linear(ops.act_and_mul(ops.linear(h, layer["gate_up"])), layer["down"])
        _, h = ops.add_rms_norm(x[step.logit_rows], pending[step.logit_rows], self.final_norm, s.rms_eps)
        return ops.linear(h, self.lm_head)


def decode_inputs(shape: LlamaShape, batch: int, context: int, device: torch.device) -> StepInputs:
    """A decode step for `batch` sequences that each have `context` tokens cached: sequence
    b owns blocks [b*per_seq, (b+1)*per_seq) and writes its new token at position `context`."""
    bs = shape.block_size
    per_seq = (context + 1 + bs - 1) // bs
    tables = torch.arange(batch * per_seq, dtype=torch.int32, device=device).view(batch, per_seq)
    slots = tables[:, context // bs].long() * bs + context % bs
    return StepInputs(
        tokens=torch.randint(0, shape.vocab, (batch,), device=device),
        positions=torch.full((batch,), context, device=device),
        slot_mapping=slots, block_tables=tables,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        cu_seqlens_q=None, logit_rows=torch.arange(batch, device=device),
    )


def prefill_inputs(shape: LlamaShape, tokens: int, device: torch.device) -> StepInputs:
    """One prompt of `tokens` tokens with nothing cached, logits for its last token."""
    bs = shape.block_size
    blocks = (tokens + bs - 1) // bs
    return StepInputs(
        tokens=torch.randint(0, shape.vocab, (tokens,), device=device),
        positions=torch.arange(tokens, device=device),
        slot_mapping=torch.arange(tokens, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).view(1, blocks),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        logit_rows=torch.tensor([tokens - 1], device=device),
    )


def blocks_needed(shape: LlamaShape, batch: int, context: int) -> int:
    return batch * ((context + 1 + shape.block_size - 1) // shape.block_size)
