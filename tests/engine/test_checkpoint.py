"""Loading checkpoints: sharded, dtypes, tied embeddings; clear errors for bad ones."""

import json
import shutil

import pytest
import torch

from splitserve.engine import LLM, CheckpointError, SamplingParams
from tests.helpers.reference import hf_greedy, hf_logprobs

PROMPT = [17, 250, 33, 401, 9, 77, 512, 5, 60]


def test_sharded_checkpoint_loads_identically(make_ckpt, checkpoint_root):
    from tests.helpers.checkpoints import make_checkpoint

    sharded = make_checkpoint(checkpoint_root / "sharded", "llama", shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    out = LLM(str(sharded), num_kv_blocks=32).generate([PROMPT], SamplingParams(temperature=0, max_tokens=8,
                                                                                ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(sharded, PROMPT, 8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_transformers(make_ckpt, dtype):
    path = make_ckpt("qwen2")
    out = LLM(str(path), dtype=dtype, num_kv_blocks=32).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1))[0]
    ref = hf_logprobs(path, PROMPT, dtype)[-1]
    # Half precision: same distribution up to rounding (tolerance, not token identity).
    assert abs(out.logprobs[0].logprob - ref[out.token_ids[0]].item()) < 0.05
    assert ref[out.token_ids[0]].item() >= ref.max().item() - 0.05


def test_tied_embeddings_share_one_tensor(make_ckpt):
    llm = LLM(str(make_ckpt("qwen2")), num_kv_blocks=8)
    model = llm.engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_cpu_float32_linear_weights_are_packed_or_stored_input_major(make_ckpt, dtype, backend, monkeypatch):
    """float32 on a CPU: under the native kernels every Linear weight (of PACK_MIN_BYTES or more)
    is packed for oneDNN (kernels/cpu_linear.py: one opaque copy, no dense one left); otherwise it lies as [in, out]
    rows (a plain GEMM for x @ W.T). Both hold the checkpoint's values; bf16 and the tied
    lm_head keep the [out, in] rows, and the tied head gets a packed copy for steps of
    several rows when it is small enough."""
    from safetensors.torch import load_file

    from splitserve.engine.models import loader
    from splitserve.kernels import cpu_linear, ops

    if backend == "native" and not cpu_linear.available():
        pytest.skip("this torch build has no oneDNN linear")
    path = make_ckpt("qwen2")
    monkeypatch.setattr(cpu_linear, "PACK_MIN_BYTES", 0)  # the test model's weights are small
    monkeypatch.setattr(loader, "TIED_HEAD_COPY_MAX", 1.0)  # (its embedding is most of its bytes)
    ops.set_backend(backend)
    try:
        llm = LLM(str(path), dtype=dtype, num_kv_blocks=8)
    finally:
        ops.set_backend(None)
    model = llm.engine.runner.model
    weights = load_file(path / "model.safetensors")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "layers.0.mlp.down_proj" in linears
    packed = dtype == "float32" and backend == "native"
    for name, layer in linears.items():
        w = layer.weight
        if name == "lm_head":  # tied to the embedding in this checkpoint
            assert w.data_ptr() == model.embed_tokens.weight.data_ptr() and w.is_contiguous()
            copy = layer.packed_weight
            assert (copy is not None) == packed and (copy is None or torch.equal(copy.to_dense(), w))
            continue
        assert w.is_mkldnn == packed, name
        assert ("weight" in dict(layer.named_parameters())) == (not packed), name
        if not packed:
            assert w.is_contiguous() == (dtype == "bfloat16"), name
            assert w.t().is_contiguous() == (dtype == "float32"), name
    down = linears["layers.0.mlp.down_proj"].weight
    down = down.to_dense() if packed else down
    assert torch.equal(down.float(), weights["model.layers.0.mlp.down_proj.weight"].to(getattr(torch, dtype)).float())
    # and computes with them: transformers' greedy tokens whichever layout it holds, one
    # sequence at a time (one-row steps) and two at once (the packed head's copy)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    other = PROMPT[1:] + [7]
    alone, together = llm.generate([PROMPT], params)[0], llm.generate([PROMPT, other], params)
    assert alone.token_ids == together[0].token_ids == hf_greedy(path, PROMPT, 8, dtype=dtype)
    assert together[1].token_ids == hf_greedy(path, other, 8, dtype=dtype)


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_names_file_and_field(make_ckpt, tmp_path):
    path = copy_ckpt(make_ckpt("llama"), tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match=r"config\.json: architecture 'GPT2LMHeadModel' is not supported; "
                                              r"supported: (\w+, )*Gemma2ForCausalLM, .*LlamaForCausalLM"):
        LLM(str(path))


def test_missing_field_malformed_json_and_missing_files(make_ckpt, tmp_path):
    path = copy_ckpt(make_ckpt("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["hidden_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="required field 'hidden_size' is missing"):
        LLM(str(path))
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        LLM(str(path))
    with pytest.raises(CheckpointError, match="config.json: not found"):
        LLM(str(tmp_path / "nowhere"))


def test_shape_mismatch_and_missing_tensor_are_named(make_ckpt, tmp_path):
    path = copy_ckpt(make_ckpt("llama"), tmp_path / "m")
    edit_config(path, intermediate_size=999)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape .*intermediate_size"):
        LLM(str(path))
    path2 = copy_ckpt(make_ckpt("llama"), tmp_path / "m2")
    from safetensors.torch import load_file, save_file

    (weights,) = path2.glob("*.safetensors")
    tensors = load_file(str(weights))
    del tensors["model.norm.weight"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks tensors for \['norm\.weight'\]"):
        LLM(str(path2))


def test_missing_tokenizer_and_weights(make_ckpt, tmp_path):
    path = copy_ckpt(make_ckpt("llama"), tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: not found"):
        LLM(str(path))
    path2 = copy_ckpt(make_ckpt("llama"), tmp_path / "m2")
    for f in path2.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        LLM(str(path2))


def test_unsupported_rope_type_is_rejected(make_ckpt, tmp_path):
    path = copy_ckpt(make_ckpt("llama"), tmp_path / "m")
    edit_config(path, rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope type 'mrope' is not supported"):
        LLM(str(path))
    edit_config(path, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match="'longrope' needs 'short_factor' and 'long_factor'"):
        LLM(str(path))


def test_prompt_errors_are_clear(make_ckpt):
    from splitserve.engine import InvalidPromptError

    llm = LLM(str(make_ckpt("llama")), num_kv_blocks=8, max_model_len=64)
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.engine.add_request("e", [], SamplingParams())
    with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
        llm.engine.add_request("v", [1, 10**6], SamplingParams())
    with pytest.raises(InvalidPromptError, match="at most 63 prompt tokens"):
        llm.engine.add_request("l", [5] * 64, SamplingParams())
    assert not llm.engine.has_unfinished_requests()
    assert torch.is_tensor(llm.engine.runner.kv_pool.data)
