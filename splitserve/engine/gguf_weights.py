"""A GGUF file's tensors as (Hugging Face name, tensor | QuantizedWeight), read memory-mapped
(the tensor table by core/gguf_file.py, dequantisation of float types and the embedding by
the `gguf` package), the way engine/checkpoint.py reads safetensors.

What llama.cpp's converter did is undone here, as transformers' GGUF loader undoes it
(transformers/modeling_gguf_pytorch_utils.py, the reference the tests compare against):
  - llama: the rows of attn_q / attn_k were permuted per head (rotary halves interleaved);
    the inverse row permutation is applied to the float tensor, or to a QuantizedWeight's
    codes, scales and offsets (rows move whole, so it stays exact);
  - gemma3: every RMSNorm weight was stored as 1 + w; 1 is subtracted again;
  - qwen3moe: each layer's experts are stacked, `ffn_{gate,up,down}_exps` [experts, rows,
    columns]; each expert's rows are yielded as its own tensor (`mlp.experts.E.gate_proj`
    ...), a quantized stack split by rows, so exactly (quantization blocks run along rows).
Block-quantized linears become QuantizedWeights EXACTLY, w = code * scale + offset per group
(kernels/quant_weight.py): Q4_0 (scale d, offset -8d), Q4_1 (d, m), Q5_0 / Q5_1 (the same
with a fifth bit), Q8_0 (int8 + 128, offset -128d), Q4_K / Q5_K (groups of 32, scale
d * sc, offset -dmin * m from 6-bit sub-scales), Q6_K (groups of 16, int8 sub-scales,
offset -32 * scale). Every product and sum is float32-exact or rounded once where
gguf.quants.dequantize rounds it (tests check equality). The token embedding is looked up,
not multiplied: it is dequantised to float (a tied lm_head shares it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from splitserve.core.gguf_file import read_gguf_header
from splitserve.core.gguf_model import FLOAT_TYPES, QUANT_TYPES
from splitserve.core.model_config import CheckpointError
from splitserve.kernels.quant_weight import QuantizedWeight

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # gemma3 (whose ffn_norm is the pre-MLP norm)
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None if this build does not know it."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    m = _BLOCK.fullmatch(gguf_name)
    if m and m[2] in _EXPERT_STACKS and arch == "qwen3moe":  # a stack of experts: `{}` is each expert's number
        return f"model.layers.{m[1]}.mlp.experts.{{}}.{_EXPERT_STACKS[m[2]]}.{m[3]}"
    if not m or m[2] not in _BLOCK_NAMES:
        return None
    part = _BLOCK_NAMES[m[2]]
    if arch == "gemma3" and m[2] == "ffn_norm":
        part = "pre_feedforward_layernorm"
    return f"model.layers.{m[1]}.{part}.{m[3]}"


def llama_row_permutation(rows: int, n_heads: int) -> torch.Tensor:
    """Indices that undo llama.cpp's per-head q/k row permutation: new[i] = stored[perm[i]]
    (transformers' LlamaTensorProcessor._reverse_permute_weights as an index)."""
    half = rows // n_heads // 2
    return torch.arange(rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[nb, bytes] packed -> [nb, 2 * bytes] codes, ggml's order: each `run` bytes give
    their low nibbles, then their high nibbles."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[nb, count // 8] little-endian bit fields -> [nb, count] of 0/1 (Q5_0, Q5_1)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")[:, :count]


def _decode_blocks(kind: str, blk: np.ndarray):
    """uint8 blocks [nb, type_size] -> (codes uint8 [nb, block], scales, offsets float32
    [nb, groups per block], group size)."""
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(blk[:, 0:2])
        m, rest = (_f16(blk[:, 2:4]), blk[:, 4:]) if kind.endswith("_1") else (None, blk[:, 2:])
        if kind.startswith("Q5"):
            high, rest = _high_bits(rest[:, :4], 32), rest[:, 4:]
            codes, offset = _nibbles(rest, 16) | (high << 4), -16 * d
        else:
            codes, offset = _nibbles(rest, 16), -8 * d
        return codes, d, (m if m is not None else offset), 32
    if kind == "Q8_0":
        d = _f16(blk[:, 0:2])
        codes = (blk[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d, -128 * d, 32
    if kind in ("Q4_K", "Q5_K"):
        from gguf.quants import Q4_K

        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blk[:, 4:16]))
        scales, offsets = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
        if kind == "Q4_K":
            return _nibbles(blk[:, 16:144], 32), scales, offsets, 32
        nb = blk.shape[0]
        qh = blk[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        return _nibbles(blk[:, 48:176], 32) | ((qh & 1).reshape(nb, -1) << 4), scales, offsets, 32
    if kind == "Q6_K":
        nb = blk.shape[0]
        ql, qh = blk[:, 0:128], blk[:, 128:192]
        scales = _f16(blk[:, 208:210]) * blk[:, 192:208].view(np.int8).astype(np.float32)
        low = (ql.reshape(nb, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        high = (qh.reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        codes = low.reshape(nb, -1) | (high.reshape(nb, -1) << 4)
        return codes, scales, -32 * scales, 16
    raise ValueError(kind)


def quantized_weight(kind: str, data: np.ndarray, out_features: int, in_features: int) -> QuantizedWeight:
    """A GGUF block-quantized matrix (uint8 [out_features, bytes per row]) as a QuantizedWeight."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = np.asarray(data).reshape(-1, type_size)
    codes, scales, offsets, group = _decode_blocks(kind, blocks)
    codes = codes.reshape(out_features, in_features)
    bits = {"Q4": 4, "Q5": 5, "Q6": 6, "Q8": 8}[kind[:2]]
    if bits == 4:  # two per byte: column 2j low nibble, 2j + 1 high
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return QuantizedWeight(
        codes=torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
        scales=torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(out_features, -1)),
        offsets=torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32).reshape(out_features, -1)),
        bits=bits, group_size=group, in_features=in_features, out_features=out_features)


def permute_rows(w: torch.Tensor | QuantizedWeight, perm: torch.Tensor):
    """w's rows in the order `perm` (any subset of them: an expert's rows of a stack)."""
    if isinstance(w, torch.Tensor):
        return w[perm]
    return QuantizedWeight(w.codes[perm].contiguous(), w.scales[perm].contiguous(), w.offsets[perm].contiguous(),
                           w.bits, w.group_size, w.in_features, len(perm))


def iter_gguf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, float32 tensor | QuantizedWeight) for every tensor of a GGUF file, read
    from a memory map."""
    from gguf import GGMLQuantizationType, dequantize

    header = read_gguf_header(path)  # core/gguf_file.py: why not gguf.GGUFReader
    arch, meta = header.architecture, header.metadata
    heads = meta.get(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in header.tensors:
        kind, name = t.type_name, hf_name(t.name, arch)
        if name is None:
            raise CheckpointError(f"{path}: tensor {t.name} ({arch}) has no counterpart in this build's models")
        if kind not in FLOAT_TYPES + QUANT_TYPES:
            raise CheckpointError(f"{path}: tensor {t.name} is {kind}, which is not supported (supported: "
                                  f"{', '.join(FLOAT_TYPES + QUANT_TYPES)})")
        raw = data[t.offset:t.offset + t.nbytes].reshape(t.shape[:-1] + (-1,))
        experts = t.shape[0] if "{}" in name and len(t.shape) == 3 else None
        if experts is not None and kind in QUANT_TYPES:  # [experts * rows, columns], split by rows below
            w = quantized_weight(kind, raw.reshape(-1, raw.shape[-1]), experts * t.shape[1], t.shape[2])
        elif kind in FLOAT_TYPES or t.name == "token_embd.weight" or len(t.shape) != 2:
            floats = dequantize(raw, GGMLQuantizationType[kind])  # F32 comes back as a view of the map: copy
            w = torch.from_numpy(np.array(floats, dtype=np.float32)).reshape(t.shape)
            w = w.reshape(-1, t.shape[-1]) if experts is not None else w
        else:
            w = quantized_weight(kind, raw, *t.shape)
        if experts is not None:
            rows = t.shape[1]
            for e in range(experts):
                yield name.format(e), permute_rows(w, torch.arange(e * rows, (e + 1) * rows))
            continue
        if "{}" in name:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {list(t.shape)}; expected [experts, rows, columns]")
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1
        if arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            w = permute_rows(w, llama_row_permutation(t.shape[0], heads if ".attn_q." in t.name else kv_heads))
        yield name, w
