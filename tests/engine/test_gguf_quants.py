"""GGUF block quantizations converted exactly to QuantizedWeight (engine/gguf_weights.py):
dequantize() equals gguf.quants.dequantize for every supported type, on blocks written by
gguf.quants.quantize (or random valid bytes where it cannot quantize: the K-quants), and
on every quantized tensor of the two real GGUF files; llama's q/k row un-permutation is
exact on a QuantizedWeight; an unsupported type is one line naming it and the tensor."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, dequantize, quants

from splitserve.core.gguf_file import read_gguf_header
from splitserve.core.model_config import CheckpointError
from splitserve.engine.gguf_weights import (
    iter_gguf_weights,
    llama_row_permutation,
    permute_rows,
    quantized_weight,
)
from tests.helpers.real_models import gemma3_gguf, smollm2_gguf

TYPES = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (5, 32), "Q5_1": (5, 32), "Q8_0": (8, 32),
         "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}
F16_SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,)}  # d (and dmin) of each K block


def blocks_for(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    qtype = GGMLQuantizationType[kind]
    try:
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    except NotImplementedError:  # gguf-py has no K-quant quantizer: random bytes, finite f16 scales
        block, size = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        view = data.reshape(-1, size)
        for at in F16_SCALE_BYTES[kind]:
            scale = rng.uniform(1e-3, 0.1, (view.shape[0], 1)).astype(np.float16).view(np.uint8)
            view[:, at:at + 2 or None] = scale
        return data


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Every element equal (torch.equal: -0.0 == +0.0; code * scale + offset gives +0.0
    where gguf's d * (q - 8) gives -0.0 for a negative d, the same number to any matmul)."""
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_each_type_dequantizes_exactly_as_gguf_does(kind):
    rows, cols = 12, 768
    data = blocks_for(kind, rows, cols, np.random.default_rng(sorted(TYPES).index(kind)))
    qw = quantized_weight(kind, data, rows, cols)
    assert (qw.bits, qw.group_size) == TYPES[kind]
    want = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).copy())
    assert same_values(qw.dequantize(), want)
    assert qw.offsets.abs().sum() > 0  # every GGUF type has an offset (-8d, m, -128d, -dmin*m, -32*scale)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_every_quantized_tensor_of_the_real_files_is_exact(model):
    path = smollm2_gguf() if model == "smollm2" else gemma3_gguf()
    kinds, data = set(), np.memmap(path, dtype=np.uint8, mode="r")
    for t in read_gguf_header(path).tensors:
        if t.type_name in TYPES and t.name != "token_embd.weight":
            raw = data[t.offset:t.offset + t.nbytes].reshape(t.shape[0], -1)
            qw = quantized_weight(t.type_name, raw, *t.shape)
            want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[t.type_name]).copy())
            assert same_values(qw.dequantize(), want), t.name
            kinds.add(t.type_name)
    assert kinds == ({"Q4_1"} if model == "smollm2" else {"Q5_0", "Q8_0", "Q4_K", "Q6_K"})


def test_row_permutation_of_a_quantized_weight_is_exact():
    data = blocks_for("Q4_K", 48, 256, np.random.default_rng(7))
    qw = quantized_weight("Q4_K", data, 48, 256)
    perm = llama_row_permutation(48, 3)
    assert sorted(perm.tolist()) == list(range(48)) and perm.tolist() != list(range(48))
    assert same_values(permute_rows(qw, perm).dequantize(), qw.dequantize()[perm])
    # what transformers does to the float tensor (LlamaTensorProcessor._reverse_permute_weights)
    w = qw.dequantize().numpy()
    ref = w.reshape(3, 8, 2, 256).swapaxes(2, 1).reshape(w.shape)
    assert np.array_equal(permute_rows(qw, perm).dequantize().numpy(), ref)


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]):
    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unsupported_tensor_type_is_one_line_naming_it(tmp_path):
    q2k = np.zeros((4, 256 // 256 * 84), dtype=np.uint8)  # Q2_K: 84 bytes per 256 values
    path = tmp_path / "q2k.gguf"
    write_gguf(path, {"output_norm.weight": (np.ones(256, np.float32), None),
                      "blk.0.ffn_up.weight": (q2k, GGMLQuantizationType.Q2_K)})
    with pytest.raises(CheckpointError, match=r"q2k\.gguf: tensor blk\.0\.ffn_up\.weight is Q2_K, which is not "
                                              r"supported \(supported: F32, F16, BF16, Q4_0"):
        list(iter_gguf_weights(path))


def test_a_file_yields_hf_names_and_quantized_weights(tmp_path):
    data = blocks_for("Q8_0", 4, 64, np.random.default_rng(3))
    path = tmp_path / "q8.gguf"
    write_gguf(path, {"blk.0.ffn_up.weight": (data, GGMLQuantizationType.Q8_0),
                      "blk.0.attn_norm.weight": (np.full(64, 0.5, np.float32), None)})
    (up_name, up), (norm_name, norm) = iter_gguf_weights(path)
    assert (up_name, norm_name) == ("model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight")
    assert up.bits == 8 and same_values(up.dequantize(), torch.from_numpy(dequantize(data, GGMLQuantizationType.Q8_0)))
    assert norm.dtype == torch.float32 and torch.equal(norm, torch.full((64,), 0.5))  # llama: stored as is
