"""`python -m splitserve.engine.gguf_derive FILE.gguf DIR`: write DIR, the derived checkpoint
directory of a GGUF file (core/gguf_model.py says why one exists).

config.json and the tokenizer come from transformers' GGUF conversion, the code
`AutoConfig/AutoTokenizer.from_pretrained(dir, gguf_file=...)` runs, so they are what
transformers serves from the same file. The chat template the GGUF carries
(`tokenizer.chat_template`) goes into tokenizer_config.json. Written to a temporary
directory beside DIR and renamed into place: a concurrent writer's rename wins, the other
directory is dropped. Exit 1 with one line on stderr when the file cannot be converted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from splitserve.core.gguf_file import read_gguf_header
from splitserve.core.gguf_model import SOURCE_FILE
from splitserve.core.model_config import CheckpointError

SUPPORTED = ("llama", "gemma3", "qwen3moe")  # GGUF architectures whose tensors engine/gguf_weights.py maps (tested)


def derive(gguf: Path, target: Path) -> Path:
    header = read_gguf_header(gguf)
    if header.architecture not in SUPPORTED:
        raise CheckpointError(f"{gguf}: GGUF architecture {header.architecture!r} is not supported (supported: "
                              f"{', '.join(SUPPORTED)})")
    template = header.metadata.get("tokenizer.chat_template")

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = transformers.AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    if header.architecture == "qwen3moe":
        fix_qwen3moe_config(config, header.metadata)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        config.save_pretrained(tmp)
        raw = json.loads((tmp / "config.json").read_text())
        raw.pop("_model_name_or_path", None)  # general.name: a label, not a path
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        tokenizer.save_pretrained(tmp)
        if template is not None:  # transformers keeps it; say it in tokenizer_config.json, where the router reads it
            (tmp / "chat_template.jinja").unlink(missing_ok=True)
            cfg_path = tmp / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["chat_template"] = template
            cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        source = {"gguf": str(gguf), "size": gguf.stat().st_size}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / SOURCE_FILE).is_file():  # not a concurrent writer that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def fix_qwen3moe_config(config, metadata: dict) -> None:
    """What transformers' GGUF conversion (5.x) leaves out of a qwen3moe config: the experts'
    width (`expert_feed_forward_length`; it keeps Qwen3MoeConfig's default 768, which only
    30B-A3B has) and the renormalised top-k weights llama.cpp's qwen3moe graph applies
    (norm_topk_prob, as every Qwen3-MoE release sets it)."""
    width = metadata.get("qwen3moe.expert_feed_forward_length")
    if width is None:
        raise CheckpointError("a qwen3moe GGUF without qwen3moe.expert_feed_forward_length (the experts' width)")
    config.moe_intermediate_size = int(width)
    config.norm_topk_prob = True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m splitserve.engine.gguf_derive FILE.gguf DIR", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # transformers' notes on unused GGUF keys are not the user's problem
    gguf, target = Path(args[0]).resolve(), Path(args[1])
    try:
        derive(gguf, target)
    except CheckpointError as exc:
        print(exc, file=sys.stderr)
        return 1
    except Exception as exc:  # transformers' conversion raises whatever a malformed file provokes
        print(f"{gguf}: cannot read its config and tokenizer ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
