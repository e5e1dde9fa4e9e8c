"""Gated DeltaNet (Qwen3-Next's `linear_attention` layers): a causal depthwise convolution
over q/k/v, then the gated delta rule, a recurrent state S [v_heads, k_dim, v_dim] per
sequence updated per token as S = exp(g) S + k (beta (v - k^T exp(g) S))^T and read by q.

The state lives in the step's RecurrentStatePool slot of each sequence (engine/
recurrent_state.py; the KV cache manager hands out the slots). A sequence starting at
position 0 starts from zeros; any later chunk of a prompt, or a decode, resumes from its
slot, so chunked prefill carries the state across steps. Prefill chunks run the chunked
form (chunks of 64 tokens, a UT transform per chunk), decodes the one-token recurrence,
batched over the step's decodes: the same torch algorithms as transformers'
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` /
`causal_conv1d_update`, which are the reference (float32 inside)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.core.model_config import ModelConfig


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta, expand: int):
    """[b, t, heads, d] -> [b, heads, t, d] in float32, q/k heads repeated to the v heads and
    L2-normalised, q scaled by its dim (as transformers with use_qk_l2norm_in_kernel)."""
    if expand > 1:
        q, k = q.repeat_interleave(expand, dim=2), k.repeat_interleave(expand, dim=2)
    q, k, v, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g)]
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64):
    """One sequence's tokens (q/k [1, t, k_heads, dk], v [1, t, v_heads, dv], g/beta [1, t, v_heads])
    from `state` [1, v_heads, dk, dv] (float32); returns (out [1, t, v_heads, dv], final state)."""
    dtype, t = q.dtype, q.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, v.shape[2] // k.shape[2])
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta)]
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :t]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor):
    """Token by token (decodes: [batch, 1, ...]), from `state` [batch, v_heads, dk, dv]."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, v.shape[2] // k.shape[2])
    s = state.to(v)
    out = torch.zeros_like(v)
    for i in range(q.shape[2]):
        s = s * g[:, :, i].exp()[..., None, None]
        delta = (v[:, :, i] - (s * k[:, :, i].unsqueeze(-1)).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
        s = s + k[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (s * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor):
    """SiLU(depthwise causal conv, `weight` [channels, 1, kernel]) of x [batch, channels, t] after
    the `state` [batch, channels, kernel - 1] of the tokens before it (zeros at a sequence's
    start); returns (y, new state)."""
    window = torch.cat([state.to(x.dtype), x], dim=-1)
    y = F.conv1d(window, weight, groups=x.shape[1])
    return F.silu(y[:, :, -x.shape[-1]:]), window[:, :, -state.shape[-1]:]


class RMSNormGated(nn.Module):
    """RMSNorm of the delta rule's output per v head, times SiLU(z) (Qwen3-Next's norm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__()
        r = cfg.raw
        self.state_index = state_index  # this layer's row in the RecurrentStatePool
        self.k_heads, self.v_heads = int(r["linear_num_key_heads"]), int(r["linear_num_value_heads"])
        self.dk, self.dv = int(r["linear_key_head_dim"]), int(r["linear_value_head_dim"])
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kernel = int(r["linear_conv_kernel_dim"])
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _split(self, x: torch.Tensor):
        """q, k [n, k_heads, dk], v, z [n, v_heads, dv], b, a [n, v_heads]: the checkpoint groups
        the projections per key head (transformers' fix_query_key_value_ordering)."""
        n, per = x.shape[0], self.v_heads // self.k_heads
        qkvz = self.in_proj_qkvz(x).view(n, self.k_heads, 2 * self.dk + 2 * per * self.dv)
        ba = self.in_proj_ba(x).view(n, self.k_heads, 2 * per)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, per * self.dv, per * self.dv], dim=2)
        b, a = torch.split(ba, [per, per], dim=2)
        return (q, k, v.reshape(n, self.v_heads, self.dv), z.reshape(n, self.v_heads, self.dv),
                b.reshape(n, self.v_heads), a.reshape(n, self.v_heads))

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        """x [n, hidden], the step's tokens; `step` a RecurrentStep (where each sequence's
        tokens are, its slot, whether it starts fresh)."""
        n = x.shape[0]
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        conv_pool, ssm_pool = step.pool.layer(self.state_index)
        out = torch.empty(n, self.v_heads, self.dv, dtype=x.dtype, device=x.device)
        p = step.num_prefills
        for i in range(p):  # prefill chunks: one sequence at a time, chunked form
            lo, hi, slot = step.offsets[i], step.offsets[i + 1], step.slots[i]
            conv0 = conv_pool[slot : slot + 1] if step.starts[i] else torch.zeros_like(conv_pool[:1])
            s0 = ssm_pool[slot : slot + 1] if step.starts[i] else torch.zeros_like(ssm_pool[:1])
            y, conv_pool[slot : slot + 1] = causal_conv1d(mixed[lo:hi].t().unsqueeze(0), conv0, self.conv1d.weight)
            o, ssm_pool[slot : slot + 1] = chunk_gated_delta_rule(*self._qkv(y), g[None, lo:hi], beta[None, lo:hi], s0)
            out[lo:hi] = o[0]
        if p < len(step.slots):  # decodes: one token each, batched
            lo, slots = step.offsets[p], step.slot_tensor[p:]
            fresh = step.fresh_tensor[p:]
            conv0 = conv_pool[slots].masked_fill(fresh[:, None, None], 0)
            s0 = ssm_pool[slots].masked_fill(fresh[:, None, None, None], 0)
            y, conv_pool[slots] = causal_conv1d(mixed[lo:].unsqueeze(-1), conv0, self.conv1d.weight)
            o, ssm_pool[slots] = recurrent_gated_delta_rule(*self._qkv(y), g[lo:, None], beta[lo:, None], s0)
            out[lo:] = o[:, 0]
        h = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(n, self.value_dim)
        return self.out_proj(h)

    def _qkv(self, y: torch.Tensor):
        """The convolution's output [b, C, t] back to q, k [b, t, k_heads, dk] and v [b, t, v_heads, dv]."""
        y = y.transpose(1, 2)
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        bsz, t = y.shape[:2]
        return q.reshape(bsz, t, self.k_heads, self.dk), k.reshape(bsz, t, self.k_heads, self.dk), \
            v.reshape(bsz, t, self.v_heads, self.dv)
