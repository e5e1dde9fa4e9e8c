"""Deterministic random-weight checkpoints: the demo model and the test models.

The demo is a small Llama with RANDOM WEIGHTS and a real byte-level BPE
tokenizer.json trained on a corpus shipped with the package. It produces
meaningless text; it exists so `splitserve serve` runs anywhere without a
download. Built on first use in ~/.cache/splitserve (or $SPLITSERVE_CACHE).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from splitserve.core.model_dir import DEMO_LABEL, DEMO_NAME, demo_dir

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def build_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE trained on the packaged corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = (Path(__file__).with_name("demo_corpus.txt")).read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def write_checkpoint(out_dir: str | Path, family: str = "llama", seed: int = 0, dtype: str = "float32",
                     shard_size: str | None = None, perturb_norms: bool = False, **config_overrides) -> Path:
    """Save a random-weight checkpoint exactly as transformers would (safetensors, tokenizer
    files, generation_config.json). `config_overrides` go to the transformers config.
    `perturb_norms`: norm weights get noise (transformers initialises them to 1, or 0 for
    Gemma's 1 + w), so a test notices a norm weight loaded into the wrong place."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    bos, eot, eot2 = (tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False}, indent=2))
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    fields = dict(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  bos_token_id=bos, eos_token_id=[eot, eot2], tie_word_embeddings=False)
    fields.update(config_overrides)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    if perturb_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(0.2 * torch.randn_like(param))
    model.generation_config.eos_token_id = [eot, eot2]
    model.generation_config.bos_token_id = bos
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(out), **kwargs)
    return out


def build_checkpoint_once(target: Path, build) -> Path:
    """`target`, made by build(tmp_dir) in a temporary directory beside it and renamed into
    place unless it exists (has a config.json): concurrent processes never see half a
    checkpoint, and the loser of a race keeps the winner's."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_demo_checkpoint() -> Path:
    """The demo checkpoint's directory, created (atomically) if it does not exist yet."""

    def build(tmp: Path) -> None:
        write_checkpoint(tmp, "llama", seed=1234, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
        (tmp / "README.md").write_text(f"# {DEMO_NAME}\n\n{DEMO_LABEL}. Built by splitserve.engine.demo.\n")

    return build_checkpoint_once(demo_dir(), build)


def main(argv: list[str] | None = None) -> int:
    path = ensure_demo_checkpoint()
    print(path)
    print(f"({DEMO_LABEL})", file=sys.stderr)
    return 0
