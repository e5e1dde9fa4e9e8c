"""A GGUF file as a checkpoint (core/gguf_model.py, engine/gguf_derive.py,
engine/gguf_weights.py), against transformers loading the same file with gguf_file=...:
the derived config.json, the tokenizer (plain and non-ASCII text, the chat template the
GGUF carries), every tensor equal after dequantisation; --model accepts the file or its
directory, names the model after the file; broken files are one line."""

import argparse
import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from splitserve.core.gguf_model import SOURCE_FILE, derived_dir, gguf_source
from splitserve.core.model_config import ModelConfig
from splitserve.core.model_dir import checkpoint_problem, resolve_model
from splitserve.core.tokenizer import Tokenizer
from splitserve.engine.gguf_weights import iter_gguf_weights
from splitserve.kernels.quant_weight import QuantizedWeight
from tests.helpers.real_models import COMPLETION_PROMPTS, derived, gemma3_gguf, smollm2_gguf

MODELS = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}
TEXTS = ["The capital of France is", "  leading spaces and\ttabs\n\nnewlines",
         "Größe, naïve café, 東京タワー, Ελληνικά, 🙂👍", "def f(x):\n    return x ** 2  # ok", "<|im_start|>literal"]
CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
               "rope_parameters", "bos_token_id", "eos_token_id", "sliding_window", "layer_types",
               "query_pre_attn_scalar", "hidden_activation", "hidden_act"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def gguf(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module", autouse=True)
def metadata_read_once():
    """transformers reads a GGUF's metadata (all of Gemma 3's 262k-token vocabulary: ~10 s) for
    AutoConfig and again for AutoTokenizer: read once per file here, a copy handed to each."""
    import copy

    from transformers import modeling_gguf_pytorch_utils as utils

    original, read = utils.load_gguf_checkpoint, {}

    def load(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in read:
            read[str(path)] = original(path, return_tensors=False)
        return copy.deepcopy(read[str(path)])

    utils.load_gguf_checkpoint = load
    yield
    utils.load_gguf_checkpoint = original


def hf_tokenizer(gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_config_is_what_transformers_derives_from_the_metadata(gguf):
    from transformers import AutoConfig

    ours = json.loads((derived(gguf) / "config.json").read_text())
    theirs = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    assert {k: ours.get(k) for k in CONFIG_KEYS} == {k: theirs.get(k) for k in CONFIG_KEYS}
    cfg = ModelConfig.from_dir(derived(gguf))
    if "SmolLM2" in gguf.name:  # the llama.* keys of the file, as llama.cpp wrote them
        assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                cfg.num_kv_heads, cfg.vocab_size) == ("LlamaForCausalLM", 576, 30, 9, 3, 49152)
        assert ours["rope_parameters"]["rope_theta"] == 100000.0 and ours["max_position_embeddings"] == 8192
    else:  # gemma3.*: sliding window 512 on five layers of six, local rope 10k, global 1M
        assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.head_dim) == (
            "Gemma3ForCausalLM", 640, 18, 256)
        assert ours["sliding_window"] == 512 and ours["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
        assert ours["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
        assert ours["rope_parameters"]["full_attention"]["rope_theta"] == 1000000.0


def test_tokenizer_encodes_and_decodes_as_transformers_does(gguf):
    ours, theirs = Tokenizer(derived(gguf)), hf_tokenizer(gguf)
    for text in TEXTS + COMPLETION_PROMPTS:  # (the latter: tests/e2e/test_real_models.py serves them)
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token == theirs.eos_token and ours.bos_token == theirs.bos_token
    if "gemma" in gguf.name:  # Gemma 3 prompts begin with BOS
        assert theirs(TEXTS[0])["input_ids"][0] == theirs.bos_token_id


def test_the_chat_template_the_gguf_carries_renders_as_in_transformers():
    from gguf import GGUFReader

    gguf = smollm2_gguf()
    shipped = GGUFReader(str(gguf)).fields["tokenizer.chat_template"].contents()
    ours, theirs = Tokenizer(derived(gguf)), hf_tokenizer(gguf)
    assert ours.chat_template == shipped
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2? ¿Y 3 + 3?"},
                {"role": "assistant", "content": "4 and 6."}, {"role": "user", "content": "Thanks!"}]
    for msgs in (messages, messages[1:2]):  # with a system turn, and the template's default one
        text = ours.apply_chat_template(msgs)
        assert text == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n")
    assert Tokenizer(derived(gemma3_gguf())).chat_template is None  # the base model ships none


def test_every_tensor_equals_transformers_state_dict(gguf):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # what from_pretrained(gguf_file=...) loads, without reading the metadata a second time
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(derived(gguf)))
    state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    names, quantized = set(), 0
    for name, w in iter_gguf_weights(gguf_source(derived(gguf))):
        if isinstance(w, QuantizedWeight):
            quantized, w = quantized + 1, w.dequantize()
        assert torch.equal(w, state[name]), name
        names.add(name)
    assert names == set(state)  # lm_head.weight: tied to the embedding in both files
    assert "lm_head.weight" not in names and model.config.tie_word_embeddings
    assert quantized == (210 if "SmolLM2" in gguf.name else 126)


def test_model_accepts_the_file_or_its_directory_and_names_it_after_the_file(tmp_path):
    gguf = smollm2_gguf()
    args = argparse.Namespace(model=str(gguf), served_model_name=None)
    model, served = resolve_model(args)
    assert (model, served) == (str(derived(gguf)), "SmolLM2-135M-Instruct.Q4_1")
    assert gguf_source(model) == gguf and (derived(gguf) / SOURCE_FILE).is_file()
    assert resolve_model(argparse.Namespace(model=str(gguf.parent), served_model_name="s")) == (model, "s")
    assert checkpoint_problem(str(gguf)) is None
    assert checkpoint_problem(model) is None  # the derived directory itself (what the workers are given)
    insisted = argparse.Namespace(model=str(gguf), served_model_name=None, quantization="gguf")
    assert resolve_model(insisted) == (model, served) and insisted.quantization is None  # the engine sees no flag


def test_the_offline_engine_takes_the_file_as_vllm_does():
    from splitserve.engine.config import EngineConfig

    gguf = smollm2_gguf()
    assert EngineConfig(model=str(gguf)).model == str(derived(gguf))  # LLM("x.gguf"), a worker given the file
    assert EngineConfig(model=str(gguf.parent)).model == str(derived(gguf))
    assert EngineConfig(model=str(derived(gguf))).model == str(derived(gguf))


def test_a_derived_directory_is_per_file_version(tmp_path):
    copy = tmp_path / "m.gguf"
    shutil.copyfile(smollm2_gguf(), copy)
    first = derived_dir(copy)
    with copy.open("ab") as f:  # same path, new content: a new directory, never a stale one
        f.write(b"\0")
    assert derived_dir(copy) != first and first.parent == derived_dir(copy).parent


def test_broken_files_are_one_line(tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"GGUF")
    assert checkpoint_problem(str(two)) == (f"{two}: holds 2 .gguf files (a.gguf, b.gguf); pass --model the one "
                                            "to serve")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    assert checkpoint_problem(str(fake)) == (f"{fake}: not a GGUF file (it does not start with the GGUF magic "
                                             "bytes)")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf().read_bytes()[:50_000])
    problem = checkpoint_problem(str(cut))
    assert problem.startswith(f"{cut}: not a readable GGUF file, truncated or garbled") and "\n" not in problem
    assert checkpoint_problem(str(tmp_path / "absent.gguf")) == f"{tmp_path / 'absent.gguf'}: GGUF file not found"
    with pytest.raises(SystemExit, match="2"):
        resolve_model(argparse.Namespace(model=str(fake), served_model_name=None))
    assert checkpoint_problem(str(smollm2_gguf()), "gptq") == (
        f"{smollm2_gguf()}: --quantization gptq given, but the model is a GGUF file (drop the flag)")
    phi = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(phi), "phi3")
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert checkpoint_problem(str(phi)) == f"{phi}: GGUF architecture 'phi3' is not supported (supported: llama, gemma3, qwen3moe)"


def test_a_second_derivation_into_the_same_directory_leaves_the_first(tmp_path):
    from splitserve.engine.gguf_derive import derive

    target = tmp_path / "derived"
    derive(smollm2_gguf(), target)
    first = {p.name: p.read_bytes() for p in target.iterdir()}
    derive(smollm2_gguf(), target)  # a concurrent worker finishing second: its rename fails, its copy is dropped
    assert {p.name: p.read_bytes() for p in target.iterdir()} == first and [p.name for p in tmp_path.iterdir()] == [
        "derived"]
    assert set(first) == {"config.json", "tokenizer.json", "tokenizer_config.json", SOURCE_FILE}
