"""What each rank holds: pure functions from the model's shape and (rank, size) to head
ranges, local sizes and the slice of each checkpoint tensor this rank loads.

- q heads split evenly; KV heads split evenly, or replicated when there are fewer KV heads
  than ranks (rank r keeps KV head r * kv // size, the one its q heads read).
- column-parallel (output rows): q/k/v, gate/up, each expert's gate/up, the LM head and
  the vocabulary rows of the embedding; row-parallel (input columns): o_proj, down_proj,
  each expert's down. One all-reduce after attention, one after the MLP.
- MoE: every rank holds a 1/size slice of every expert's intermediate dimension (tensor-
  parallel experts), not whole experts (expert-parallel): the router's choices then need no
  token exchange between ranks, the load is even whatever the routing, and the MLP's one
  all-reduce is the same as a dense layer's. Expert parallelism pays off at expert counts
  and batch sizes far above what one worker sees; it is opt-in (--enable-expert-parallel,
  parallel/expert_parallel.py): each rank then reads its E/size experts whole and nothing of
  the others' (expert_checkpoint_shard).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from splitserve.core.model_config import CheckpointError, ModelConfig, shardable_problem
from splitserve.engine.parallel.expert_parallel import local_experts
from splitserve.engine.parallel.state import TPState
from splitserve.kernels.quant_weight import PACKED, QuantizedWeight


@dataclass(frozen=True)
class Shard:
    """This rank's part of a checkpoint tensor: `length` entries from `start` along `dim`,
    then zero rows up to `padded` (the vocabulary's last rank)."""

    dim: int
    start: int
    length: int
    padded: int | None = None


def vocab_rows(vocab_size: int, t: TPState) -> tuple[int, int, int]:
    """(first row, rows held, rows padded to): ceil(vocab / size) rows per rank, so any
    vocabulary splits; the last rank's padding rows are zero and their logits are dropped."""
    per = -(-vocab_size // t.size)
    start = min(vocab_size, t.rank * per)
    return start, min(vocab_size, start + per) - start, per


def even_split(total: int, t: TPState) -> tuple[int, int]:
    per = total // t.size
    return t.rank * per, per


def q_heads(cfg: ModelConfig, t: TPState) -> tuple[int, int]:
    """(first head, number of heads) of this rank's query heads."""
    return even_split(cfg.num_heads, t)


def kv_heads(cfg: ModelConfig, t: TPState) -> tuple[int, int]:
    """(first KV head, number): an even split, or the one KV head this rank's q heads read."""
    if cfg.num_kv_heads >= t.size:
        return even_split(cfg.num_kv_heads, t)
    return t.rank * cfg.num_kv_heads // t.size, 1


def check_shardable(cfg: ModelConfig, size: int, source: str) -> None:
    """One line saying why this model cannot run on `size` ranks, or nothing."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    why = shardable_problem(cfg, size)  # torch-free, in core: serve checks it before any process starts
    if why:
        raise CheckpointError(f"{source}: {cfg.architecture} cannot run with tensor_parallel_size={size}: {why}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_PREFIX = r"(?:mlp|block_sparse_moe)"
_EXPERT_ROWS = re.compile(rf"^{_PREFIX}\.experts\.\d+\.(?:w1|w3|gate_proj|up_proj)$")
_EXPERT = re.compile(rf"^{_PREFIX}\.experts\.(\d+)\.(?:w1|w3|w2|gate_proj|up_proj|down_proj)$")
_EXPERT_COLS = re.compile(rf"^{_PREFIX}\.experts\.\d+\.(?:w2|down_proj)$")
_STACKED = re.compile(rf"^model\.layers\.\d+\.{_PREFIX}\.experts\.(?:gate_up_proj|down_proj)$")


def checkpoint_shard(name: str, cfg: ModelConfig, t: TPState) -> Shard | None:
    """The part of checkpoint tensor `name` this rank loads; None: all of it (replicated,
    or a row-parallel bias, which rank 0 alone adds)."""
    if t.size == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Shard(0, *vocab_rows(cfg.vocab_size, t))
    if cfg.family == "gpt_oss" and (shard := gpt_oss_shard(name, cfg, t)) is not _NOT_GPT_OSS:
        return shard
    if t.expert_parallel and is_routed_expert(name):
        return expert_checkpoint_shard(name, cfg, t)
    if _STACKED.match(name):
        raise CheckpointError(f"tensor '{name}': stacked expert tensors cannot be split per rank yet "
                              "(save the checkpoint with one tensor per expert)")
    m = _LAYER.match(name)
    if not m:
        return None
    module, kind = m.group(2), m.group(3)
    if cfg.kv_lora_rank and module.startswith("self_attn."):
        return _mla_shard(module, kind, cfg, t)
    d = cfg.head_dim
    if module == "self_attn.q_proj":
        first, n = q_heads(cfg, t)
        return Shard(0, first * d, n * d)
    if module in ("self_attn.k_proj", "self_attn.v_proj"):
        first, n = kv_heads(cfg, t)
        return Shard(0, first * d, n * d)
    if module == "self_attn.o_proj":
        return Shard(1, *map(lambda v: v * d, q_heads(cfg, t))) if kind == "weight" else None
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return Shard(0, *even_split(cfg.intermediate_size, t))
    if module == "mlp.down_proj":
        return Shard(1, *even_split(cfg.intermediate_size, t)) if kind == "weight" else None
    if module in ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"):  # GLM-4.5, DeepSeek-V3
        return Shard(0, *even_split(cfg.moe_intermediate_size * cfg.n_shared_experts, t))
    if module == "mlp.shared_experts.down_proj":
        return Shard(1, *even_split(cfg.moe_intermediate_size * cfg.n_shared_experts, t)) if kind == "weight" else None
    if _EXPERT_ROWS.match(module):
        return Shard(0, *even_split(cfg.moe_intermediate_size, t))
    if _EXPERT_COLS.match(module):
        return Shard(1, *even_split(cfg.moe_intermediate_size, t))
    return None  # norms, the router: replicated


_GPT_OSS_SINKS = re.compile(r"^model\.layers\.\d+\.self_attn\.sinks$")
_GPT_OSS_EXPERTS = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_NOT_GPT_OSS = Shard(-1, 0, 0)  # gpt_oss_shard: not one of gpt-oss's own tensors
# one expert's MXFP4 projection as engine/quant/reader.py yields it: a QuantizedWeight [2I, H] / [H, I]
_GPT_OSS_QUANTIZED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_up_proj|down_proj)\.weight$")


def gpt_oss_shard(name: str, cfg: ModelConfig, t: TPState) -> Shard | None:
    """gpt-oss's sinks (this rank's q heads) and stacked experts (engine/models/gpt_oss_moe.py):
    under expert parallelism this rank's experts whole; else each expert's slice of the
    intermediate dimension, which for gate_up_proj [E, H, 2I] (gate and up interleaved) is one
    contiguous run of 2I/n columns; down_proj_bias whole (rank 0 adds it)."""
    if _GPT_OSS_SINKS.match(name):
        return Shard(0, *q_heads(cfg, t))
    if q := _GPT_OSS_QUANTIZED.match(name):  # the same split, in the weight's [out, in] rows and columns
        if t.expert_parallel:
            first, count = local_experts(cfg, t)
            return None if first <= int(q.group(1)) < first + count else NOTHING
        first, n = even_split(cfg.moe_intermediate_size, t)
        return Shard(0, 2 * first, 2 * n) if q.group(2) == "gate_up_proj" else Shard(1, first, n)
    m = _GPT_OSS_EXPERTS.match(name)
    if not m:
        return _NOT_GPT_OSS
    if t.expert_parallel:
        return Shard(0, *local_experts(cfg, t))
    first, n = even_split(cfg.moe_intermediate_size, t)
    if m.group(1) == "gate_up_proj":
        return Shard(1 if m.group(2) else 2, 2 * first, 2 * n)
    return None if m.group(2) else Shard(1, first, n)


def _mla_shard(module: str, kind: str, cfg: ModelConfig, t: TPState) -> Shard | None:
    """Multi-head latent attention (engine/models/mla.py): the per-head up-projections split by
    head (q: nope + rope rows a head, kv_b: nope + v rows a head), o_proj by its v columns; the
    down-projections to the latents and their norms are replicated, and so is the latent cache."""
    first, n = q_heads(cfg, t)
    per_head = {"self_attn.q_proj": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                "self_attn.q_b_proj": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                "self_attn.kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim}.get(module)
    if per_head:
        return Shard(0, first * per_head, n * per_head)
    if module == "self_attn.o_proj":
        return Shard(1, first * cfg.v_head_dim, n * cfg.v_head_dim) if kind == "weight" else None
    return None  # q_a_proj, kv_a_proj_with_mqa, q_a_layernorm, kv_a_layernorm


NOTHING = Shard(0, 0, 0)  # another rank's expert: not read (the model's weight_target skips it)


def is_routed_expert(name: str) -> bool:
    """Whether checkpoint tensor `name` is a routed expert's (one expert's or a stacked one)."""
    m = _LAYER.match(name)
    return bool(_STACKED.match(name) or (m and _EXPERT.match(m.group(2))))


def expert_checkpoint_shard(name: str, cfg: ModelConfig, t: TPState) -> Shard | None:
    """Under expert parallelism, the part of routed expert tensor `name` this rank reads:
    its own experts' rows of a stacked tensor, all of its own experts' tensors (None), and
    NOTHING of another rank's expert."""
    first, count = local_experts(cfg, t)
    if _STACKED.match(name):
        return Shard(0, first, count)
    expert = int(_EXPERT.match(_LAYER.match(name).group(2)).group(1))
    return None if first <= expert < first + count else NOTHING


ShardOf = Callable[[str], "Shard | None"]  # checkpoint name -> this rank's part


def sharded(weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], shard_of: ShardOf,
            source: str) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A weight stream narrowed to this rank's parts (for sources that read whole tensors:
    quantized and GGUF readers)."""
    for name, tensor in weights:
        shard = shard_of(name)
        yield name, tensor if shard is None else narrow(tensor, shard, f"{source}: {name}")


def read_shard(tensor_slice, shard: Shard, name: str) -> torch.Tensor:
    """This rank's part read through a safetensors slice: only its bytes leave the file."""
    part = tensor_slice[(slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)]
    return narrow(part, Shard(shard.dim, 0, shard.length, shard.padded), name)


def narrow(tensor: torch.Tensor | QuantizedWeight, shard: Shard, name: str):
    """This rank's part of a checkpoint tensor. A quantized weight splits exactly by output
    rows; by input columns only at its group boundaries and without an act-order permutation
    (a group's scale must stay whole on one rank)."""
    pad = 0 if shard.padded is None else shard.padded - shard.length
    if isinstance(tensor, torch.Tensor):
        part = tensor.narrow(shard.dim, shard.start, shard.length)
        return torch.cat([part, part.new_zeros(pad, *part.shape[1:])]) if pad else part
    q, start, n = tensor, shard.start, shard.length
    if pad:  # zero codes, scales and offsets: zero rows
        q = QuantizedWeight(*(None if t is None else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
                              for t in (q.codes, q.scales, q.offsets)), q.bits, q.group_size, q.in_features,
                            q.out_features + pad, q.input_perm)
        n += pad
    off = q.offsets
    # clones: a view would keep the whole checkpoint tensor alive in this rank
    if shard.dim == 0:
        return QuantizedWeight(q.codes[start:start + n].clone(), q.scales[start:start + n].clone(),
                               None if off is None else off[start:start + n].clone(), q.bits, q.group_size,
                               q.in_features, n, q.input_perm)
    g = q.group_size
    if q.input_perm is not None or start % g or n % g:
        raise CheckpointError(f"{name}: its input columns {start}:{start + n} do not fall on the "
                              f"quantization groups ({g} columns{', act-order' if q.input_perm is not None else ''}),"
                              " so it cannot be split across ranks")
    per_code = 2 if q.bits in PACKED else 1  # 4-bit and FP4 codes: two a byte
    groups = slice(start // g, (start + n) // g)
    return QuantizedWeight(q.codes[:, start // per_code:(start + n) // per_code].clone(),
                           q.scales[:, groups].clone(), None if off is None else off[:, groups].clone(),
                           q.bits, g, n, q.out_features, None)
