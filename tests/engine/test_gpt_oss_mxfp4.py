"""gpt-oss's MXFP4 twin: tests/engine/test_gpt_oss.py's tiny random checkpoint with its experts
written in the shipped on-disk layout (`mlp.experts.{gate_up,down}_proj_blocks` uint8
[E, N, K / 32, 16] and `_scales` E8M0 [E, N, K / 32], quantized here from the float experts;
the biases, attention, router, embeddings and head stay float; config.json's
quantization_config as the released gpt-oss's: quant_method mxfp4 with its
modules_to_not_convert). Through LLM (the experts stay MXFP4, packed nibbles in
QuantizedWeight's FP4 layout: engine/quant/mxfp4.py, engine/models/gpt_oss_quant.py) greedy tokens equal
transformers' loading the same checkpoint dequantised (Mxfp4Config(dequantize=True), float32),
whose expert weights are bit-equal to ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.core.model_dir import checkpoint_problem
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.gpt_oss_quant import QuantizedGptOssExperts
from splitserve.kernels.quant_weight import E2M1, FP4
from tests.engine.test_gpt_oss import NEW_TOKENS, prompts, write_gpt_oss

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32]): per 32
    columns the power of two putting the largest magnitude at or under 6, each value rounded to the
    nearest E2M1 (ties to the lower code), column 2j in the low nibble."""
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4_twin(float_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    for f in float_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, t in load_file(str(float_dir / "model.safetensors")).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers keeps [E, in, out] (x @ w); the checkpoint's blocks are [E, out, in / 32, 16]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return write_mxfp4_twin(write_gpt_oss(root / "float"), root / "mxfp4")


def transformers_dequantized(model_dir: Path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    return model.eval()


def test_mxfp4_twin_greedy_tokens_equal_transformers_dequantised(twin):
    assert checkpoint_problem(str(twin)) is None and checkpoint_problem(str(twin), "mxfp4") is None
    reference = transformers_dequantized(twin)
    llm = LLM(str(twin), num_kv_blocks=64, max_num_batched_tokens=32)
    model = llm.engine.runner.model
    for layer, hf_layer in zip(model.layers, reference.model.layers, strict=True):
        experts = layer.mlp.experts
        assert isinstance(experts, QuantizedGptOssExperts)
        for e in range(experts.num_experts):
            for ours, theirs in ((experts.gate_up[e], hf_layer.mlp.experts.gate_up_proj[e]),
                                 (experts.down[e], hf_layer.mlp.experts.down_proj[e])):
                (part,) = ours.parts
                assert (part.bits, part.group_size) == (FP4, 32)
                assert torch.equal(part.dequantize().T.view(torch.int32), theirs.detach().view(torch.int32))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(prompts(llm.engine.model_config.vocab_size), llm.generate(
            prompts(llm.engine.model_config.vocab_size), params), strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
